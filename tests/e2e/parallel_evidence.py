"""Evidence readers shared by the parallel-equivalence tests of slime's loop (``test_slime_parallel_*.py``): the
tensors of a weight version slime pushed, compared byte for byte."""

from __future__ import annotations

from pathlib import Path


def tensors(directory: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of the safetensors files in ``directory``: name -> (dtype, shape, raw bytes)."""
    import torch
    from safetensors import safe_open

    out = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                t = f.get_tensor(name).contiguous()
                assert name not in out, f"{name} in two files of {directory}"
                out[name] = (str(t.dtype), tuple(t.shape), t.view(torch.uint8).numpy().tobytes())
    assert out, f"no safetensors tensors in {directory}"
    return out


def assert_same_tensors(pushed: Path, reference: Path) -> None:
    """The same tensor names, dtypes, shapes and bytes in both directories."""
    got, want = tensors(pushed), tensors(reference)
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for name in want:
        assert got[name][:2] == want[name][:2], (name, got[name][:2], want[name][:2])
        assert got[name][2] == want[name][2], f"{name}: bytes differ between {pushed} and {reference}"


def fp32_copy(src: Path, out: Path) -> Path:
    """``src`` (an HF safetensors checkpoint) with every tensor upcast to float32: the weights as a job that trains
    in fp32 (``bf16: false``) pushes them before its first step. ``slime-ascend quantize`` of this copy is what a
    quantised sync plugin must push as its first version (quantising the BF16 originals rounds some int8 values
    differently: the scales are computed in the input's dtype)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    for path in out.glob("*.safetensors"):
        save_file({k: v.float() for k, v in load_file(str(path)).items()}, str(path), metadata={"format": "pt"})
    return out
