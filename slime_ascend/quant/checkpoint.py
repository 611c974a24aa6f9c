"""Offline conversion of an HF safetensors checkpoint, bit-exact verification, dequantised loading.

Only safetensors are read (never torch.load / pickle). The converter streams one tensor at a
time through `quantize_named_params` (the same function weight sync calls), so an online
sync of the same BF16 weights reproduces the offline files bit for bit; `verify_*` checks it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..files import json_object
from ._common import all_finite, raise_if_not_finite
from ._outdir import check_out_dir, staged_dir
from ._source import INDEX_SUFFIX, SourceFile, check_source, copy_no_wider, open_checked, publish_mode
from .hf_config import (
    ASCEND_DESCRIPTION_FILE, ASCEND_FLOAT, ASCEND_QUANT_TYPES, ascend_quant_description,
    quantization_config_for, read_checkpoint_quant_config, spec_from_checkpoint, spec_from_quantization_config,
)
from .name_policy import module_of
from .params import SpecLike, as_spec, dequantize_named_params, quantize_named_params
from .schemes import QuantSpec

DEFAULT_SHARD_BYTES = 5 * 1024**3


# ----------------------------------------------------------------------------- reading
def open_safetensors(path: str, device: str = "cpu") -> Any:
    """``safe_open`` of the file ``path``; a file whose header safetensors cannot read (truncated, empty, not
    safetensors) is a ValueError naming it."""
    try:
        return safe_open(path, framework="pt", device=device)
    except OSError:
        raise  # names the path itself
    except Exception as exc:  # noqa: BLE001 - SafetensorError is not exported as a stable type
        raise ValueError(f"{path}: not a readable safetensors file ({' '.join(str(exc).split())}). Fix: write or "
                         "download it again (a truncated, empty or non-safetensors file cannot be read)") from None


class CheckpointReader:
    """Name -> tensor access over every `*.safetensors` file in a directory (lazy, mmap)."""

    def __init__(self, path: str | os.PathLike[str], device: str = "cpu") -> None:
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise ValueError(f"checkpoint path {self.path!r} is not a directory")
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"{self.path}: no *.safetensors files (only safetensors checkpoints are "
                             f"supported; convert .bin/.pt files with a trusted tool first)")
        for fname in files:  # stat, not open: a FIFO would block
            mode = os.stat(os.path.join(self.path, fname)).st_mode
            if not stat.S_ISREG(mode):
                raise ValueError(f"{os.path.join(self.path, fname)!r} is not a regular file; it is not opened. "
                                 f"Fix: remove it, or replace it with the safetensors file")
        self.device = device
        self._handles: dict[str, Any] = {}
        self.file_of: dict[str, str] = {}
        for fname in files:
            h = open_safetensors(os.path.join(self.path, fname), device)
            self._handles[fname] = h
            for k in h.keys():
                if k in self.file_of:
                    raise ValueError(f"{self.path}: tensor {k!r} is in both {self.file_of[k]} and {fname}")
                self.file_of[k] = fname

    def keys(self) -> list[str]:
        return list(self.file_of)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        return self._handles[self.file_of[name]].get_tensor(name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for fname, h in self._handles.items():
            for k in h.keys():
                yield k, h.get_tensor(k)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- writing
class _ShardWriter:
    def __init__(self, out_dir: str, prefix: str, max_bytes: int) -> None:
        self.out_dir, self.prefix, self.max_bytes = out_dir, prefix, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[dict[str, torch.Tensor] | list[str]] = []
        self.tmp_names: list[str] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = t.detach().to("cpu").contiguous()
        self.pending_bytes += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        tmp = os.path.join(self.out_dir, f".{self.prefix}-part{len(self.tmp_names):05d}.tmp")
        try:
            save_file(self.pending, tmp, metadata={"format": "pt"})
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors reports a full disk as its own error type
            code = re.search(r"os error (\d+)", str(exc))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), tmp) from None
        self.tmp_names.append(tmp)
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> dict[str, str]:
        if self.pending or not self.tmp_names:
            self._flush()
        n = len(self.tmp_names)
        weight_map: dict[str, str] = {}
        for i, (tmp, names) in enumerate(zip(self.tmp_names, self.shards)):
            final = f"{self.prefix}.safetensors" if n == 1 else f"{self.prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.out_dir, final))
            for k in names:
                weight_map[k] = final
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(self.out_dir, f"{self.prefix}{INDEX_SUFFIX}"), "w") as f:
            json.dump(index, f, indent=2)
        return weight_map


@dataclass
class ConvertReport:
    fmt: str
    out_dir: str
    quantized: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def convert_checkpoint(
    hf_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    fmt: SpecLike,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    device: str = "cpu",
    overwrite: bool = False,
    progress: Callable[[int, int, int], None] | None = None,
    names: tuple[str, str, str] = ("hf_dir", "out_dir", "overwrite=True"),
) -> ConvertReport:
    """Quantise an HF BF16 safetensors checkpoint into `fmt` (a format name of `quant.names.FORMATS`, or a
    QuantSpec).

    Writes quantised safetensors shards (`model-*.safetensors`, or msModelSlim's
    `quant_model_weights*.safetensors` for Ascend) with an index, config.json with
    `quantization_config` (removed for Ascend, which gets `quant_model_description.json`),
    and copies every other non-weight file (tokenizer, generation config, chat template).
    A file of `hf_dir` that links outside it, or is no regular file (FIFO, device), is refused
    before anything is opened; no output file is given a wider mode than its source (the shards,
    index and description no wider than the narrowest source shard).

    `out_dir` may not be, lie inside, or contain `hf_dir` (symlinks resolved). Everything is
    written to a temporary directory beside it and moved into place only on success; with
    `overwrite`, a non-empty `out_dir` is replaced only if it holds a checkpoint (config.json +
    *.safetensors), and only after the new one is complete. A NaN/inf in any floating tensor,
    quantised or passed through, is refused naming the tensor and its file. ``progress(done, total,
    bytes_read)`` is called after each source tensor. ``names``: how errors name the source, the output and
    the overwrite switch (the CLI passes ``("HF_DIR", "OUT_DIR", "--force")``). Two conversions into one
    `out_dir` cannot both succeed: the second is refused while the first runs (``_outdir.output_lock``).
    """
    src, dst = os.fspath(hf_dir), os.fspath(out_dir)
    spec = as_spec(fmt)
    src_label, out_label, force_flag = names
    dst_real = check_out_dir(src, dst, overwrite, label=out_label, src_label=src_label, force_flag=force_flag)
    files = check_source(src, label="hf_dir")
    if "config.json" not in files:
        raise ValueError(f"{src}: no config.json; expected an HF checkpoint directory")
    with open_checked(files["config.json"]) as f:
        raw = f.read()
    try:
        config = json_object(raw, files["config.json"].path)
    except ValueError as exc:
        raise ValueError(f"{exc}. Fix: restore the checkpoint's config.json (an HF config, a JSON object)") from None
    if read_checkpoint_quant_config(src):
        raise ValueError(f"{src}: checkpoint is already quantised; convert from the BF16 checkpoint")

    report = ConvertReport(fmt=spec.fmt, out_dir=dst)
    # Written into a private temporary directory beside out_dir and moved into place only when
    # complete: a failure or Ctrl-C leaves the previous out_dir (if any) untouched.
    with staged_dir(dst_real, overwrite, label=out_label, force_flag=force_flag) as work:
        _write_converted(src, files, work, spec, config, report, max_shard_bytes, device, progress)
    report.files = sorted(os.listdir(dst_real))
    return report


def _write_converted(src: str, files: dict[str, SourceFile], dst: str, spec: QuantSpec, config: dict[str, Any],
                     report: ConvertReport, max_shard_bytes: int, device: str,
                     progress: Callable[[int, int, int], None] | None = None) -> None:
    ascend_type = ASCEND_QUANT_TYPES.get(spec.fmt)  # msModelSlim layout: a description, no quantization_config
    prefix = "quant_model_weights" if ascend_type else "model"
    writer = _ShardWriter(dst, prefix, max_shard_bytes)
    types: dict[str, str] = {}
    not_converted: list[str] = []
    with CheckpointReader(src, device=device) as reader:
        names, read = list(reader.keys()), 0
        for done, name in enumerate(names, 1):
            t = reader.get(name)
            read += t.numel() * t.element_size()
            try:
                outs = quantize_named_params([(name, t)], spec)
                passthrough = len(outs) == 1 and outs[0][1] is t
                if passthrough:
                    raise_if_not_finite(all_finite(t), name, what="tensor", action="pass it through unquantised")
            except ValueError as exc:  # name the file as well as the tensor
                raise ValueError(f"{os.path.join(src, reader.file_of[name])}: {exc}") from None
            if passthrough:
                report.kept.append(name)
                types[name] = ASCEND_FLOAT
                if name.endswith(".weight") and t.dim() >= 2:
                    not_converted.append(module_of(name))
            else:
                report.quantized.append(name)
                for out_name, _ in outs:
                    types[out_name] = ascend_type or "quantized"  # (only an Ascend description reads it)
            for out_name, out_t in outs:
                writer.add(out_name, out_t)
            del t, outs
            if progress is not None:
                progress(done, len(names), read)
    writer.close()

    shards_mode = 0o777  # the weight files' outputs: no wider than the narrowest source shard
    for name, source in files.items():
        if name.endswith(".safetensors"):
            shards_mode &= source.mode
    if ascend_type:
        config.pop("quantization_config", None)
        if isinstance(config.get("text_config"), dict):
            config["text_config"].pop("quantization_config", None)
        with open(os.path.join(dst, ASCEND_DESCRIPTION_FILE), "w") as f:
            json.dump(ascend_quant_description(types, ascend_type), f, indent=2)
    else:
        config["quantization_config"] = quantization_config_for(spec, not_converted)
    for fname in os.listdir(dst):
        publish_mode(os.path.join(dst, fname), shards_mode)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    publish_mode(os.path.join(dst, "config.json"), files["config.json"].mode)

    for fname, source in files.items():
        if fname not in ("config.json", ASCEND_DESCRIPTION_FILE) and not fname.endswith(".safetensors"):
            copy_no_wider(source, os.path.join(dst, fname))


# ----------------------------------------------------------------------------- verification
def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.reshape(-1).view(torch.uint8)


def tensors_bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(_bits(a), _bits(b))


@dataclass
class TensorCheck:
    name: str
    ok: bool
    reason: str = ""
    differing_bytes: int = 0


@dataclass
class VerifyReport:
    ok: bool
    checked: int
    mismatches: list[TensorCheck] = field(default_factory=list)
    missing_in_checkpoint: list[str] = field(default_factory=list)
    not_synced: list[str] = field(default_factory=list)

    def summary(self) -> str:
        head = "OK" if self.ok else "FAIL"
        lines = [f"{head}: {self.checked} tensors checked, {len(self.mismatches)} mismatched, "
                 f"{len(self.missing_in_checkpoint)} missing in checkpoint, {len(self.not_synced)} not synced"]
        lines += [f"  {m.name}: {m.reason}" for m in self.mismatches[:20]]
        lines += [f"  missing: {n}" for n in self.missing_in_checkpoint[:20]]
        return "\n".join(lines)


def _check(name: str, got: torch.Tensor, ref: torch.Tensor) -> TensorCheck:
    if got.dtype != ref.dtype:
        return TensorCheck(name, False, f"dtype {got.dtype} != checkpoint {ref.dtype}")
    if tuple(got.shape) != tuple(ref.shape):
        return TensorCheck(name, False, f"shape {tuple(got.shape)} != checkpoint {tuple(ref.shape)}")
    a, b = _bits(got), _bits(ref)
    n = int((a != b).sum())
    return TensorCheck(name, n == 0, "" if n == 0 else f"{n} bytes differ", n)


def _compare(report: VerifyReport, reader: CheckpointReader, named: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Check each (name, tensor) against `reader`'s tensor of that name bit for bit, into `report`; the names seen."""
    seen: set[str] = set()
    for name, t in named:
        seen.add(name)
        if name not in reader:
            report.missing_in_checkpoint.append(name)
            continue
        c = _check(name, t, reader.get(name))
        report.checked += 1
        if not c.ok:
            report.mismatches.append(c)
    return seen


def verify_tensor(
    ckpt: str | os.PathLike[str] | CheckpointReader, name: str, tensor: torch.Tensor
) -> TensorCheck:
    """Compare one synced tensor with the same-named tensor of an offline checkpoint, bit for bit."""
    reader = ckpt if isinstance(ckpt, CheckpointReader) else CheckpointReader(ckpt)
    if name not in reader:
        return TensorCheck(name, False, "not in checkpoint")
    return _check(name, tensor, reader.get(name))


def verify_named_tensors(
    ckpt: str | os.PathLike[str] | CheckpointReader, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> VerifyReport:
    """Bit-exact check of (name, tensor) pairs (e.g. one sync bucket) against a checkpoint."""
    report = VerifyReport(ok=True, checked=0)
    _compare(report, ckpt if isinstance(ckpt, CheckpointReader) else CheckpointReader(ckpt), named_tensors)
    report.ok = not report.mismatches and not report.missing_in_checkpoint
    return report


def verify_against_checkpoint(
    quant_dir: str | os.PathLike[str],
    source: str | os.PathLike[str] | Iterable[tuple[str, torch.Tensor]],
    fmt: SpecLike | None = None,
    *,
    require_all: bool = True,
) -> VerifyReport:
    """Quantise `source` (an HF BF16 checkpoint dir, or (name, tensor) pairs as weight sync
    sees them) online with the checkpoint's own spec and compare with `quant_dir` bit for bit.

    `fmt` defaults to the spec read from `quant_dir` (config.json / Ascend description).
    With `require_all`, checkpoint tensors that the source never produced are reported in
    `not_synced` and fail the check.
    """
    qdir = os.fspath(quant_dir)
    if fmt is None:
        spec = spec_from_checkpoint(qdir)
        if spec is None:
            raise ValueError(f"{qdir}: cannot detect a quantisation format; pass fmt")
    else:
        spec = as_spec(fmt)
    reader = CheckpointReader(qdir)
    if isinstance(source, (str, os.PathLike)):
        src_reader = CheckpointReader(source)
        pairs: Iterable[tuple[str, torch.Tensor]] = src_reader.items()
    else:
        pairs = source
    report = VerifyReport(ok=True, checked=0)
    # one source tensor at a time: quantised, then compared
    seen = _compare(report, reader, (out for pair in pairs for out in quantize_named_params([pair], spec)))
    if require_all:
        report.not_synced = sorted(set(reader.keys()) - seen)
    report.ok = not report.mismatches and not report.missing_in_checkpoint and not report.not_synced
    return report


# ----------------------------------------------------------------------------- dequantised loading
def load_state_dict_dequantized(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Read a checkpoint in any of our formats (or an unquantised one) and return dense weights
    under the original HF names; floating tensors are cast to `dtype`."""
    p = os.fspath(path)
    _checkpoint_spec(p)  # an unsupported config is refused before anything is read
    with CheckpointReader(p, device=device) as reader:
        named = dict(reader.items())
    return dequantize_stored(p, named, dtype)


def dequantize_stored(path: str | os.PathLike[str], named: dict[str, torch.Tensor],
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Dense weights under the original HF names from ``named``, the tensors of the checkpoint at ``path`` as
    stored (read by the caller, e.g. the reference engine, which keeps them to serve them: one read of the
    files); its quantisation config is read from ``path``. Floating tensors are cast to ``dtype``."""
    spec = _checkpoint_spec(os.fspath(path))
    if spec is None:
        return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in named.items()}
    return dequantize_named_params(named, spec, dtype)


def _checkpoint_spec(p: str) -> QuantSpec | None:
    qcfg = read_checkpoint_quant_config(p)
    spec = spec_from_quantization_config(qcfg) if qcfg else None
    if qcfg and spec is None:
        method = qcfg.get("quant_method", qcfg.get("model_quant_type"))
        raise ValueError(f"{p}: unsupported quantization config {method!r}")
    return spec


quant_spec_of = spec_from_checkpoint  # the QuantSpec a quantised checkpoint was written with (None: unquantised)


__all__ = [
    "CheckpointReader", "ConvertReport", "TensorCheck", "VerifyReport", "convert_checkpoint",
    "dequantize_stored", "load_state_dict_dequantized", "quant_spec_of", "tensors_bit_equal", "verify_against_checkpoint",
    "verify_named_tensors", "verify_tensor",
]

