"""Host tensors across processes in ``/update_weights_from_tensor``: what :func:`serialize_named_tensors` writes is
what slime's ``MultiprocessingSerializer`` writes, handles to shared memory, and the torch engine's restricted
unpickler reads it back (in a process that did not write it)."""

from __future__ import annotations

import subprocess
import sys

import torch

from slime_ascend.weight_sync.tensor_sharing import serialize_named_tensors, use_file_system_sharing


def test_a_serialized_bucket_opens_in_another_process_as_the_same_tensors(tmp_path):
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    use_file_system_sharing()
    try:
        named = [("a.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4).share_memory_()),
                 ("b.bias", torch.tensor([1, -2, 3], dtype=torch.bfloat16).share_memory_())]
        text = serialize_named_tensors(named)
        assert len(text) < 2000  # handles, not bytes
        code = ("import sys, torch\n"
                "from slime_ascend.rollout.torch_engine.tensor_update import decode_named_tensors\n"
                "pairs = decode_named_tensors([sys.stdin.read()], None)\n"
                "print([(n, t.dtype, t.tolist()) for n, t in pairs])\n")
        out = subprocess.run([sys.executable, "-c", code], input=text, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == str([(n, t.dtype, t.tolist()) for n, t in named])
    finally:
        mp.set_sharing_strategy(before)
