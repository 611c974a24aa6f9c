"""MXFP8 (OCP Microscaling Formats v1.0): e4m3 elements, one power-of-two E8M0 scale per 32 values.

The rule, exactly (``x`` a block of 32 consecutive values along the last dimension, computed in fp32,
which holds every bf16/fp16/fp32 input exactly):

1. ``amax = max |x_i|`` over the block.
2. Shared exponent (OCP v1.0 section 6.3, ``X = 2^(floor(log2(amax)) - emax_elem)`` with
   ``emax_elem = 8`` for e4m3, whose largest normal is 1.75 * 2^8 = 448):
   ``shared = floor(log2(amax)) - 8``, clamped to E8M0's range [-127, 127]. ``floor(log2(amax))`` is
   amax's fp32 exponent field minus 127 (exact for normal amax; a subnormal or zero amax has field 0,
   which gives -135 and clamps to -127, the same value an exact log2 clamps to, because every
   amax < 2^-119 lands there). An all-zero block therefore gets scale 2^-127 (byte 0) and zero elements.
3. The stored scale byte is ``shared + 127`` (E8M0: value 2^(byte - 127); byte 255 is NaN and is
   never written), kept as uint8.
4. Elements: ``q_i = e4m3fn(clamp(x_i / 2^shared, -448, 448))``, the cast rounding to nearest, ties to
   even (torch's cast). The division by a power of two is exact wherever the result can matter
   (it is computed as ``x_i * 2^-shared`` with ``2^-shared`` a normal fp32, exact unless the product
   is an fp32 subnormal, which is far below e4m3's smallest subnormal 2^-9 and rounds to 0 either way).
   Because ``amax / 2^shared`` lies in [256, 512), values above 448 saturate to ±448 (OCP's
   "clamp to max normal"; e4m3fn has no inf, and torch's unclamped cast would give NaN). The sign of
   zero is kept (-0.0 -> byte 0x80).
5. NaN / inf: OCP sets the block's scale to NaN (0xFF). We refuse the tensor instead, with the same
   one-line error as the other formats: a poisoned weight is never synced or written.
6. K (the last dimension) must be a multiple of 32; other shapes are refused (keep such a tensor
   unquantised: add it to the ignore list). torch_npu's ``npu_dynamic_mx_quant`` pads a short last block
   with zeros, but the engines' loaders size ``weight_scale`` as K/32, so a padded scale would not load.

Where this matches the engines: torch_npu's ``npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn)``
(aclnnDynamicMxQuant, scale_alg 0 = "OCP Microscaling Formats (Mx) Specification", round_mode
"rint") computes the same ``floor(log2(amax)) - emax`` exponent (emax 8 for FLOAT8_E4M3FN) and
returns its scale as [..., ceil(K/64), 2] uint8: the [..., K/32] bytes written here, reshaped (when
K/32 is even). SGLang's Ascend loader (``ModelSlimMXFP8Scheme``) and vllm-ascend load msModelSlim's
``W8A8_MXFP8`` layout: ``X.weight`` float8_e4m3fn [N, K] and ``X.weight_scale`` uint8 [N, K/32]
(the loader reshapes it to [N, K/64, 2], so those engines need K/32 even), with a
``quant_model_description.json`` naming each quantised tensor ``W8A8_MXFP8``. That is the layout
``slime-ascend quantize --format mxfp8`` writes and the ``mxfp8-sync`` plugin sends. The bit-for-bit
agreement with a device's own kernel is checked where one is present; on CPU the rule above is checked
against a Fraction-exact reference (``tests/quant/test_mxfp8.py``).

3-D inputs are stacked experts [E, N, K]: the blocks run along K either way. Work is done in row
chunks so the fp32 staging stays bounded. Pure torch, any device.
"""

from __future__ import annotations

import torch

from ._common import DEFAULT_CHUNK_ELEMS, check_float_weight, check_out, raise_if_not_finite, rows_per_chunk

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.uint8  # E8M0 bytes, as msModelSlim writes them (torch.float8_e8m0fnu is a view of it)
BLOCK = 32
E4M3_EMAX = 8  # exponent of e4m3's largest normal, 448 = 1.75 * 2^8
E4M3_MAX = 448.0
E8M0_BIAS = 127
SCALE_MIN_BYTE, SCALE_MAX_BYTE = 0, 254  # 2^-127 .. 2^127; 255 is NaN


def mxfp8_scale_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    *lead, k = shape
    return (*lead, k // BLOCK)


def check_mxfp8_shape(weight: torch.Tensor, name: str) -> None:
    k = weight.shape[-1]
    if k % BLOCK:
        raise ValueError(f"{name}: last dimension {k} (shape {tuple(weight.shape)}) is not a multiple of {BLOCK}; "
                         f"MXFP8 blocks are {BLOCK} values along it. Fix: keep this tensor unquantised (add its "
                         f"module to the ignore list)")


def quantize_mxfp8(
    weight: torch.Tensor,
    *,
    name: str = "weight",
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (q float8_e4m3fn, same shape as `weight`; scale uint8 E8M0 [.., K/32]) by the module's rule.

    `out`: optional preallocated (q, scale) to write into (e.g. a reused sync buffer)."""
    check_float_weight(weight, name)
    check_mxfp8_shape(weight, name)
    s_shape = mxfp8_scale_shape(weight.shape)
    if out is None:
        q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
        s = torch.empty(s_shape, dtype=SCALE_DTYPE, device=weight.device)
    else:
        q, s = out
        check_out(q, weight.shape, FP8_DTYPE, f"{name}: out[0]")
        check_out(s, s_shape, SCALE_DTYPE, f"{name}: out[1]")
    k = weight.shape[-1]
    if weight.numel() == 0:
        return q, s
    w2 = weight.reshape(-1, k)
    q2, s2 = q.view(-1, k), s.view(-1, k // BLOCK)
    n = w2.shape[0]
    step = min(rows_per_chunk(k, chunk_elems), n)
    buf = torch.empty(step * k, dtype=torch.float32, device=weight.device)
    ok = torch.ones((), dtype=torch.bool, device=weight.device)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        y = buf[: (r1 - r0) * k].view(r1 - r0, k // BLOCK, BLOCK)
        y.view(r1 - r0, k).copy_(w2[r0:r1])  # fp32 staging (exact)
        amax = torch.maximum(y.amax(dim=-1), y.amin(dim=-1).neg_())  # NaN propagates, inf stays inf
        ok = ok & torch.isfinite(amax).all()
        byte, inv = _scale_of(amax)
        s2[r0:r1].copy_(byte)
        y.mul_(inv.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX)
        q2[r0:r1].copy_(y.view(r1 - r0, k))
    raise_if_not_finite(ok, name)
    return q, s


def _scale_of(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block |max| (fp32, >= 0) -> (E8M0 byte as uint8, 2^-shared as fp32): steps 2-3 of the rule."""
    field = (amax.view(torch.int32) >> 23) & 0xFF  # floor(log2(amax)) + 127 for a normal amax
    byte = (field - E4M3_EMAX).clamp_(SCALE_MIN_BYTE, SCALE_MAX_BYTE)
    # 2^-(byte - 127) has exponent field 254 - byte: in [8, 254] (byte <= 247 even for a
    # non-finite amax, which is refused afterwards), always a normal fp32
    inv = ((2 * E8M0_BIAS - byte) << 23).to(torch.int32).view(torch.float32)
    return byte.to(SCALE_DTYPE), inv


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) -> fp32 powers of two 2^(byte - 127); 255 -> NaN."""
    if scale.dtype != SCALE_DTYPE:
        raise TypeError(f"scale must be uint8 E8M0 bytes, got {scale.dtype}")
    b = scale.to(torch.int32)
    return torch.where(b == 255, torch.full_like(b, 0x7FC00000).view(torch.float32),
                       torch.ldexp(torch.ones_like(b, dtype=torch.float32), b - E8M0_BIAS))


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp32(q) * 2^(scale - 127) per block of 32, computed in fp32 (exact) and cast to `dtype`."""
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"q must be float8_e4m3fn, got {q.dtype}")
    if q.shape[-1] % BLOCK or tuple(scale.shape) != mxfp8_scale_shape(q.shape):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)} "
                         f"(expected {mxfp8_scale_shape(q.shape)})")
    k = q.shape[-1]
    y = q.float().view(*q.shape[:-1], k // BLOCK, BLOCK) * e8m0_to_float(scale).unsqueeze(-1)
    return y.view(q.shape).to(dtype)
