"""How CPU tensors cross processes in slime's colocated push (``update_weights_from_tensor``)."""

from __future__ import annotations

from typing import Any


def use_file_system_sharing(_module: Any = None) -> None:
    """Pickle CPU tensors as named shared-memory files (``file_system``), which an unrelated process (the
    engine) can open; the default ``file_descriptor`` handles reach children of the sender only."""
    import torch.multiprocessing as mp

    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")


def serialize_named_tensors(named: list[tuple[str, Any]]) -> str:
    """``(name, tensor)`` pairs as one string of ``serialized_named_tensors`` (SGLang's format without
    ``load_format``), written as sglang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` writes it:
    torch's ``ForkingPickler``, base64. The tensors travel as handles to their shared memory (call
    :func:`use_file_system_sharing` first for host tensors), so they must stay alive until the engine answered."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reducers with ForkingPickler)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode()
