"""``tito`` (token-in/token-out): train on the exact token IDs the engine sampled, with the same tokenizer.

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

Fingerprint (``tok:<16 hex>/tpl:<16 hex>``): ``tok`` hashes the tokenizer files of a checkpoint
directory (tokenizer.json, tokenizer.model, vocab/merges files, special_tokens_map.json,
added_tokens.json and tokenizer_config.json without its chat_template); ``tpl`` hashes the chat
template (tokenizer_config.json's ``chat_template`` and chat_template.jinja / .json). For a hub id
(not a directory) the tokenizer is loaded with transformers and its vocabulary, special tokens and
chat template are hashed instead. Not caught: an engine that uses a tokenizer path other than
``args.hf_checkpoint``.
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
import logging
import os
import socket
import sys
import threading
from typing import Any

__all__ = [
    "TitoError",
    "check_samples",
    "check_train_rollout",
    "check_train_tokenizer",
    "record_sample",
    "reset_state",
    "token_digest",
    "tokenizer_fingerprint",
]

logger = logging.getLogger("slime_ascend.tito")

META_KEY = "ascend_tito"
KV_NAMESPACE = "slime_ascend"
KV_KEYS = {"rollout": "tito/rollout_tokenizer", "train": "tito/train_tokenizer"}

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
    "special_tokens_map.json", "added_tokens.json", "tokenizer.tiktoken", "qwen.tiktoken",
)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class TitoError(ValueError):
    """Training would not use the rollout's tokens or tokenizer. The message says what differs."""


_lock = threading.Lock()
_state: dict[str, Any] = {"published": set(), "checked_rollout": False}


def reset_state() -> None:
    with _lock:
        _state.update(published=set(), checked_rollout=False)
    tokenizer_fingerprint.cache_clear()


# ---- digests ---------------------------------------------------------------------------------------
def token_digest(tokens: Any) -> str:
    """16-byte BLAKE2b hex digest of a token-ID sequence (list, tuple or 1-D integer tensor)."""
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    try:
        data = array.array("q", tokens).tobytes()
    except (TypeError, OverflowError) as e:
        raise TitoError(f"tokens must be a sequence of integer token IDs: {e}") from None
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _h() -> Any:
    return hashlib.blake2b(digest_size=8)


@functools.lru_cache(maxsize=8)
def tokenizer_fingerprint(path: str) -> dict[str, str]:
    """``{"revision": "tok:…/tpl:…", "tokenizer": …, "chat_template": …, "path": …, "host": …}``."""
    tok, tpl = _h(), _h()
    if os.path.isdir(path):
        found = False
        for name in TOKENIZER_FILES:
            fp = os.path.join(path, name)
            if os.path.isfile(fp):
                found = True
                tok.update(name.encode() + b"\0")
                with open(fp, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        tok.update(block)
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            found = True
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            template = cfg.pop("chat_template", None)
            tok.update(b"tokenizer_config.json\0" + json.dumps(cfg, sort_keys=True).encode())
            if template is not None:
                tpl.update(json.dumps(template, sort_keys=True).encode())
        for name in TEMPLATE_FILES:
            fp = os.path.join(path, name)
            if os.path.isfile(fp):
                with open(fp, "rb") as f:
                    tpl.update(name.encode() + b"\0" + f.read())
        if not found:
            raise TitoError(f"no tokenizer files in {path!r} (looked for {TOKENIZER_FILES} and tokenizer_config.json)")
    else:
        from transformers import AutoTokenizer

        t = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        tok.update(json.dumps(sorted(t.get_vocab().items())).encode())
        tok.update(json.dumps(t.special_tokens_map, sort_keys=True, default=str).encode())
        tpl.update(json.dumps(getattr(t, "chat_template", None), sort_keys=True).encode())
    tok_hex, tpl_hex = tok.hexdigest(), tpl.hexdigest()
    return {"revision": f"tok:{tok_hex}/tpl:{tpl_hex}", "tokenizer": tok_hex, "chat_template": tpl_hex,
            "path": path, "host": socket.gethostname()}


def _side_fingerprint(args: Any) -> dict[str, str] | None:
    path = getattr(args, "hf_checkpoint", None)
    if not path:
        return None
    return tokenizer_fingerprint(str(path))


def _describe(fp: dict[str, str]) -> str:
    return f"{fp['revision']} ({fp['path']} on {fp['host']})"


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


def compare_fingerprints(side: str, mine: dict[str, str] | None, pinned: str | None,
                         peer: dict[str, str] | None) -> None:
    """Raise :class:`TitoError` when ``mine`` differs from the pinned revision or the other side's."""
    if mine is None:
        if pinned:
            raise TitoError(f"ascend_tito_tokenizer_revision is set to {pinned!r} but args.hf_checkpoint is unset on "
                            f"the {side} side, so its tokenizer cannot be checked. Fix: set --hf-checkpoint")
        return
    if pinned and mine["revision"] != pinned:
        raise TitoError(
            f"{side} side tokenizer/chat-template revision {_describe(mine)} differs from the pinned "
            f"ascend_tito_tokenizer_revision {pinned!r}. Fix: point --hf-checkpoint at the same tokenizer revision "
            "on every node, or update the pin"
        )
    if peer is not None and peer["revision"] != mine["revision"]:
        other = "train" if side == "rollout" else "rollout"
        what = [n for n in ("tokenizer", "chat_template") if peer.get(n) != mine.get(n)]
        raise TitoError(
            f"tokenizer/chat-template revisions differ ({' and '.join(what)}): {side} side {_describe(mine)}, "
            f"{other} side {_describe(peer)}. Training would not see the tokens the engine produced with the same "
            "vocabulary/template. Fix: make --hf-checkpoint the same revision on rollout and train nodes"
        )


def _check_side(args: Any, side: str) -> dict[str, str] | None:
    """This side's fingerprint: published for the other side, compared with the pin and the other side's."""
    from ..plugins import runtime

    mine = _side_fingerprint(args)
    if mine is not None:
        _publish(side, mine)
        if side == "train":
            logger.info("tito: train-side tokenizer revision %s", _describe(mine))
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


def _sample_problems(sample: Any, record: dict[str, Any], tokenizer: str | None) -> list[str]:
    problems = []
    n, digest = len(sample.tokens), token_digest(sample.tokens)
    if n != record["n_tokens"] or digest != record["tokens"]:
        problems.append(f"token IDs changed after generation (length {record['n_tokens']} -> {n}, digest "
                        f"{record['tokens'][:12]} -> {digest[:12]})")
    if int(sample.response_length) != record["response_length"]:
        problems.append(f"response_length changed after generation ({record['response_length']} -> "
                        f"{sample.response_length})")
    for name in ("loss_mask", "rollout_log_probs"):
        value = getattr(sample, name, None)
        if value is not None and len(value) != sample.response_length:
            problems.append(f"{name} has {len(value)} entries for response_length {sample.response_length}")
    if tokenizer is not None and record.get("tokenizer") not in (None, tokenizer):
        problems.append(f"generated under tokenizer revision {record['tokenizer']}, now {tokenizer}")
    return problems


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
        problems = _sample_problems(sample, record, None if fp is None else fp["revision"])
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


def main(argv: list[str] | None = None) -> int:
    """``slime-ascend tito-fingerprint HF_CHECKPOINT``: print the revision to pin as ascend_tito_tokenizer_revision."""
    from ..command import ArgumentParser

    parser = ArgumentParser(prog="slime-ascend tito-fingerprint",
                                     description="print the tokenizer/chat-template revision of a checkpoint "
                                     "(the value for ascend_tito_tokenizer_revision)")
    parser.add_argument("hf_checkpoint", help="checkpoint directory or hub id (what --hf-checkpoint gets)")
    target = parser.parse_args(argv).hf_checkpoint
    if target.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(target)):
        print(f"error: {target} is not a directory. Fix: pass the checkpoint directory --hf-checkpoint gets "
              "(or a hub id)", file=sys.stderr)
        return 2
    try:
        print(tokenizer_fingerprint(target)["revision"])
    except (TitoError, OSError, ValueError) as exc:
        text = " ".join(str(exc).split()).rstrip(".")
        print(f"error: {text}" + ("" if "Fix:" in text else ". Fix: pass a checkpoint directory with its tokenizer "
                                  "files (or a hub id in the local cache)"), file=sys.stderr)
        return 2
    return 0
