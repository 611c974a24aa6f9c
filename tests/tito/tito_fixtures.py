"""A checkpoint directory with just the tokenizer files the tito fingerprint reads."""

from __future__ import annotations

import json


def tokenizer_dir(path, template="{{ messages }}", vocab=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab or {"a": 0, "b": 1}}}))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "b"}))
    return str(path)
