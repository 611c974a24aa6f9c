"""Teachers that one engine switches between (``ascend_opd_switch_engine_urls``) must be one architecture.

The pool switches an engine from teacher to teacher with ``/update_weights_from_disk``: the engine keeps its
model and loads the next teacher's tensors into it. SGLang (and the torch engine) refuse a checkpoint of another
shape only when the switch comes, in the scoring path of a rollout, and a teacher whose tensors merely rename or
resize would fail there after the first teachers had scored. Checked at start instead (the driver's and the
RolloutManager's ``parse_args``), from each checkpoint's ``config.json`` (``model_type``, ``architectures``) and
its safetensors headers (every tensor's name and shape; no tensor data is read): the first difference is named in
one line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from .safetensors_dir import tensor_layout

__all__ = ["architecture_mismatch"]

CONFIG_FIELDS = ("model_type", "architectures")


def _config(ckpt_dir: Path) -> dict:
    try:
        return json.loads((ckpt_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def architecture_mismatch(teachers: Sequence[tuple[str, Path]]) -> str | None:
    """The first way the checkpoints ``teachers`` (name, directory) differ in architecture, as a sentence naming
    both teachers, or None when they are one architecture. A teacher whose directory holds no safetensors is
    skipped (the pool marks it failed when it validates it)."""
    first: tuple[str, Path, dict, dict[str, tuple[int, ...]]] | None = None
    for name, ckpt_dir in teachers:
        ckpt_dir = Path(ckpt_dir)
        try:
            layout = tensor_layout(ckpt_dir)
        except (OSError, ValueError):
            continue
        if not layout:
            continue
        config = _config(ckpt_dir)
        if first is None:
            first = (name, ckpt_dir, config, layout)
            continue
        name0, dir0, config0, layout0 = first
        for field in CONFIG_FIELDS:
            if config.get(field) != config0.get(field):
                return (f"config.json {field} is {config0.get(field)!r} in {name0!r} ({dir0}) and "
                        f"{config.get(field)!r} in {name!r} ({ckpt_dir})")
        for tensor in sorted(layout0.keys() | layout.keys()):
            shape0, shape = layout0.get(tensor), layout.get(tensor)
            if shape0 != shape:
                def show(s):
                    return "missing" if s is None else list(s)
                return (f"tensor {tensor} is {show(shape0)} in {name0!r} ({dir0}) and {show(shape)} in {name!r} "
                        f"({ckpt_dir})")
    return None
