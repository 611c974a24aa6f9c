"""Token digests and tokenizer fingerprints, and their comparisons: the plain functions behind the ``tito``
hooks (:mod:`slime_ascend.tito.hooks`), ``slime-ascend tito-fingerprint`` (:mod:`slime_ascend.tito.cli`) and
opd's teacher/student check (:mod:`slime_ascend.opd.compat`). Nothing here caches or imports slime or Ray.

Fingerprint (``tok:<16 hex>/tpl:<16 hex>``): ``tok`` hashes the tokenizer files of a checkpoint
directory (tokenizer.json, tokenizer.model, vocab/merges files, special_tokens_map.json,
added_tokens.json and tokenizer_config.json without its chat_template); ``tpl`` hashes the chat
template (tokenizer_config.json's ``chat_template`` and chat_template.jinja / .json). For a hub id
(not a directory) the tokenizer is loaded with transformers and its vocabulary, special tokens and
chat template are hashed instead.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import socket
from typing import Any

__all__ = [
    "TitoError",
    "compare_fingerprints",
    "describe",
    "sample_problems",
    "token_digest",
    "tokenizer_fingerprint",
]

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
    "special_tokens_map.json", "added_tokens.json", "tokenizer.tiktoken", "qwen.tiktoken",
)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class TitoError(ValueError):
    """Training would not use the rollout's tokens or tokenizer. The message says what differs."""


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
            from ..files import read_json_object

            try:
                cfg = read_json_object(cfg_path)
            except ValueError as exc:
                raise TitoError(f"{exc}. Fix: restore the checkpoint's tokenizer_config.json (a JSON object)") from None
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


def describe(fp: dict[str, str]) -> str:
    return f"{fp['revision']} ({fp['path']} on {fp['host']})"


# ---- comparisons -----------------------------------------------------------------------------------
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
            f"{side} side tokenizer/chat-template revision {describe(mine)} differs from the pinned "
            f"ascend_tito_tokenizer_revision {pinned!r}. Fix: point --hf-checkpoint at the same tokenizer revision "
            "on every node, or update the pin"
        )
    if peer is not None and peer["revision"] != mine["revision"]:
        other = "train" if side == "rollout" else "rollout"
        what = [n for n in ("tokenizer", "chat_template") if peer.get(n) != mine.get(n)]
        raise TitoError(
            f"tokenizer/chat-template revisions differ ({' and '.join(what)}): {side} side {describe(mine)}, "
            f"{other} side {describe(peer)}. Training would not see the tokens the engine produced with the same "
            "vocabulary/template. Fix: make --hf-checkpoint the same revision on rollout and train nodes"
        )


def sample_problems(sample: Any, record: dict[str, Any], tokenizer: str | None) -> list[str]:
    """What changed on ``sample`` since ``record`` was taken at generation (empty: nothing)."""
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
