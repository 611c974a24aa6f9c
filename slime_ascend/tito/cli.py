"""``slime-ascend tito-fingerprint HF_CHECKPOINT``: print the tokenizer/chat-template revision of a checkpoint,
the value to pin as ``ascend_tito_tokenizer_revision`` (see :mod:`slime_ascend.tito.fingerprint`)."""

from __future__ import annotations

import os
import sys

from ..command import ArgumentParser
from .fingerprint import TitoError, tokenizer_fingerprint

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``slime-ascend tito-fingerprint HF_CHECKPOINT``: print the revision to pin as ascend_tito_tokenizer_revision."""
    parser = ArgumentParser(prog="slime-ascend tito-fingerprint",
                            description="print the tokenizer/chat-template revision of a checkpoint "
                            "(the value for ascend_tito_tokenizer_revision)")
    parser.add_argument("hf_checkpoint", help="checkpoint directory or hub id (what slime's --hf-checkpoint gets)")
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
