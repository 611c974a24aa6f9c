"""``train.cpu_tensor_reductions`` on real slime and sglang: after slime's weight iterator installed sglang's tensor
reducer, a host tensor cannot be serialised for ``update_weights_from_tensor`` (IndexError); with the patch slime's
colocated bucket is serialised and the torch engine reads it back byte for byte, and a CUDA tensor would still go
to sglang's reducer.

The reducer is process-wide (torch's ``ForkingPickler`` registry), so the check runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

from slime_ascend.patch.train.cpu_tensor_reductions import MODULE, PATCH

from conftest import need

SCRIPT = textwrap.dedent("""
    import importlib, json
    import torch
    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")  # what the torch-engine plugin sets in slime's train actors
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    from torch.multiprocessing import reductions

    from slime_ascend.patch.train.cpu_tensor_reductions import MODULE, PATCH
    from slime_ascend.rollout.torch_engine.tensor_update import decode_named_tensors

    iterator = importlib.import_module(MODULE)
    # what the sync plugins push: bf16, int8 (int8-sync) and float8 (fp8-sync) weights with float32 scales
    named = [("a.weight", torch.randn(4, 3).to(torch.bfloat16)), ("a.weight_scale", torch.rand(4, 1)),
             ("b.weight", torch.randint(-127, 128, (2, 8), dtype=torch.int8)),
             ("c.weight", (torch.randn(3, 8) * 100).to(torch.float8_e4m3fn)), ("c.weight_scale_inv", torch.rand(1, 1))]

    def serialize():
        bucket = FlattenedTensorBucket(named_tensors=named)
        data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        return MultiprocessingSerializer.serialize(data, output_str=True), data

    out = {"plain": bool(serialize()[0])}
    iterator.monkey_patch_torch_reductions()  # slime's call, unpatched: sglang's reducer from here on
    sglang_reducer = reductions.reduce_tensor
    try:
        serialize()
        out["unpatched"] = "serialised"
    except IndexError as exc:
        out["unpatched"] = f"IndexError: {exc}"
    out["verify"] = PATCH.verify()
    PATCH.install()
    iterator.monkey_patch_torch_reductions()  # slime's call again, through the patch
    text, alive = serialize()
    got = decode_named_tensors([text], "flattened_bucket")
    out["names"] = [n for n, _ in got]
    out["same_bytes"] = all(g.dtype == t.dtype and torch.equal(g.view(torch.uint8), t.view(torch.uint8))
                            for (_, g), (_, t) in zip(got, named))
    out["cuda_goes_to_sglang"] = reductions.reduce_tensor.__wrapped__ is sglang_reducer
    iterator.monkey_patch_torch_reductions()  # idempotent: one wrapper
    out["wrapped_once"] = reductions.reduce_tensor.__wrapped__ is sglang_reducer
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slime
def test_slime_colocated_bucket_serialises_after_sglangs_reducer():
    need(MODULE)
    need("sglang.srt.weight_sync.tensor_bucket")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    assert out["plain"] is True
    assert out["unpatched"] == "IndexError: tuple index out of range", out  # the blocker on the host
    assert out["verify"] == []
    assert out["names"] == ["a.weight", "a.weight_scale", "b.weight", "c.weight", "c.weight_scale_inv"], out
    assert out["same_bytes"] is True, out
    assert out["cuda_goes_to_sglang"] is True and out["wrapped_once"] is True, out


def test_refuses_a_changed_target():
    fake = types.ModuleType(MODULE)

    def _get_megatron_full_params(infos, weights):  # slime no longer installs sglang's reducer here
        return []

    fake.monkey_patch_torch_reductions = lambda: None
    fake._get_megatron_full_params = _get_megatron_full_params
    problems = PATCH.check({MODULE: fake})
    assert problems and "monkey_patch_torch_reductions()" in problems[0], problems
    del fake.monkey_patch_torch_reductions
    assert "monkey_patch_torch_reductions" in PATCH.check({MODULE: fake})[0]
