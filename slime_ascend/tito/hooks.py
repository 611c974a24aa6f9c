"""``tito`` (token-in/token-out): train on the exact token IDs the engine sampled, with the same tokenizer.

The hooks (declared in :mod:`slime_ascend.tito.plugin`) are thin adapters between slime's hook slots and the
digests, fingerprints and comparisons of :mod:`slime_ascend.tito.fingerprint`; what they add is this
process's state (a cache of fingerprints, what it published) and the exchange with the other side.

What it catches:

1. **Tokens changed after generation.** ``record_sample`` (rollout_sample_hook, order 900; slime calls
   it right after each sample is generated) stores a digest of ``sample.tokens`` with its length and
   ``response_length`` in ``sample.metadata["ascend_tito"]``. ``check_samples`` (reward_post_process,
   order 900: the last step before slime copies ``sample.tokens`` verbatim into the train data)
   recomputes it and fails, naming the sample, when anything in between (a reward function, a later
   hook, a re-encode of the text, a multi-turn rebuild) changed the IDs or their length, or when the
   loss mask or rollout log-probs no longer line up with the response.
2. **Different tokenizer or chat-template revision on the two sides.** A fingerprint of the tokenizer
   at ``args.hf_checkpoint`` (each side reads its own copy of the checkpoint) is recorded at rollout
   and computed at train start (megatron_init). With ``ascend_tito_tokenizer_revision`` set, each side
   must match it; otherwise the rollout side and the train side publish theirs in Ray's KV store and
   each compares with the other's when present (the train side again before every rollout's
   training, in rollout_data_postprocess, when the rollout side has necessarily published). A
   mismatch fails with both revisions, their paths and hosts.

Not caught: an engine that uses a tokenizer path other than ``args.hf_checkpoint``.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from typing import Any

from .fingerprint import TitoError, compare_fingerprints, describe, sample_problems, token_digest, tokenizer_fingerprint

__all__ = [
    "check_samples",
    "check_train_rollout",
    "check_train_tokenizer",
    "record_sample",
    "reset_state",
]

logger = logging.getLogger("slime_ascend.tito")

META_KEY = "ascend_tito"
KV_NAMESPACE = "slime_ascend"
KV_KEYS = {"rollout": "tito/rollout_tokenizer", "train": "tito/train_tokenizer"}

_lock = threading.Lock()
_state: dict[str, Any] = {"published": set(), "checked_rollout": False}
# one fingerprint per checkpoint path and process (reset_state forgets them)
_cached_fingerprint = functools.lru_cache(maxsize=8)(tokenizer_fingerprint)


def reset_state() -> None:
    with _lock:
        _state.update(published=set(), checked_rollout=False)
    _cached_fingerprint.cache_clear()


def _side_fingerprint(args: Any) -> dict[str, str] | None:
    path = getattr(args, "hf_checkpoint", None)
    if not path:
        return None
    return _cached_fingerprint(str(path))


# ---- cross-side exchange (Ray KV) ------------------------------------------------------------------
def _kv():
    try:
        import ray
        from ray.experimental import internal_kv
    except ImportError:
        return None
    if not ray.is_initialized() or not internal_kv._internal_kv_initialized():
        return None
    return internal_kv


def _publish(side: str, fp: dict[str, str]) -> None:
    with _lock:
        if side in _state["published"]:
            return
        _state["published"].add(side)
    kv = _kv()
    if kv is not None:
        kv._internal_kv_put(KV_KEYS[side], json.dumps(fp), overwrite=True, namespace=KV_NAMESPACE)


def _peer(side: str) -> dict[str, str] | None:
    kv = _kv()
    if kv is None:
        return None
    raw = kv._internal_kv_get(KV_KEYS["train" if side == "rollout" else "rollout"], namespace=KV_NAMESPACE)
    return None if raw is None else json.loads(raw)


def _check_side(args: Any, side: str) -> dict[str, str] | None:
    """This side's fingerprint: published for the other side, compared with the pin and the other side's."""
    from ..plugins import runtime

    mine = _side_fingerprint(args)
    if mine is not None:
        _publish(side, mine)
        if side == "train":
            logger.info("tito: train-side tokenizer revision %s", describe(mine))
    compare_fingerprints(side, mine, runtime.settings(args, "tito").tokenizer_revision, _peer(side))
    return mine


# ---- hooks -----------------------------------------------------------------------------------------
def record_sample(args: Any, sample: Any, *, rollout_id: int | None = None, evaluation: bool = False) -> Any:
    """rollout_sample_hook (order 900): record the token digest and tokenizer revision on the sample."""
    fp = _check_side(args, "rollout")
    if getattr(sample, "metadata", None) is None:
        sample.metadata = {}
    sample.metadata[META_KEY] = {
        "tokens": token_digest(sample.tokens),
        "n_tokens": len(sample.tokens),
        "response_length": int(sample.response_length),
        "tokenizer": None if fp is None else fp["revision"],
    }
    return sample


def check_samples(args: Any, samples: list, raw_rewards: list, rewards: list) -> tuple[list, list]:
    """reward_post_process (order 900): fail when a sample's tokens differ from what was generated."""
    from ..plugins import runtime

    fp = _check_side(args, "rollout")
    require = runtime.settings(args, "tito").require_record
    bad, missing, checked = [], [], 0
    for sample in samples:
        record = (getattr(sample, "metadata", None) or {}).get(META_KEY)
        if record is None:
            status = str(getattr(getattr(sample, "status", None), "name", "")).upper()
            if not getattr(sample, "remove_sample", False) and status not in ("ABORTED", "FAILED"):
                missing.append(sample.index)  # aborted samples skip the hooks and train nothing once removed
            continue
        checked += 1
        problems = sample_problems(sample, record, None if fp is None else fp["revision"])
        if problems:
            bad.append(f"sample index={sample.index}: " + "; ".join(problems))
    if bad:
        raise TitoError(
            f"{len(bad)} of {len(samples)} samples would not train on their rollout tokens:\n  " + "\n  ".join(bad[:10])
            + ("\n  ..." if len(bad) > 10 else "")
            + "\nFix: keep sample.tokens exactly as the engine returned them (append with "
            "Sample.append_response_tokens; never re-tokenize text between generation and training)"
        )
    if missing and require:
        raise TitoError(
            f"{len(missing)} of {len(samples)} samples (indices {missing[:10]}) carry no tito record, so their tokens "
            "cannot be checked: the rollout did not run slime's rollout sample hooks (slime_ascend.hooks."
            "rollout_sample_hook). Fix: use a rollout function that applies them, or set "
            "ascend_tito_require_record: false"
        )
    from ..plugins.rollout_metrics import report

    report(args, logger, "tito", {"rollout/tito_checked_samples": float(checked),
                                  "rollout/tito_unrecorded_samples": float(len(missing))})
    return raw_rewards, rewards


def check_train_tokenizer(args: Any) -> None:
    """megatron_init (order 900): train-side fingerprint vs the pin and the rollout side's."""
    _check_side(args, "train")


def check_train_rollout(args: Any, rollout_id: int, rollout_data: dict) -> None:
    """rollout_data_postprocess (order 900): compare with the rollout side once it has published."""
    with _lock:
        if _state["checked_rollout"]:
            return
    peer = _peer("train")
    if peer is None:
        return
    from ..plugins import runtime

    compare_fingerprints("train", _side_fingerprint(args), runtime.settings(args, "tito").tokenizer_revision, peer)
    with _lock:
        _state["checked_rollout"] = True
