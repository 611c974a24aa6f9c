"""The checkpoint formats and INT4 numerics by name (no torch: the CLI's parser reads them)."""

FP8_BLOCK = "fp8-block"
INT8_W8A8 = "int8-w8a8"
INT8_CT = "int8-ct"
INT4_GROUP = "int4-group"
MXFP8 = "mxfp8"  # OCP MX: e4m3 + one E8M0 scale per 32 values (msModelSlim W8A8_MXFP8 layout)
FORMATS: tuple[str, ...] = (FP8_BLOCK, INT8_W8A8, INT8_CT, INT4_GROUP, MXFP8)

INT4_NUMERICS: tuple[str, ...] = ("compressed-tensors", "torchao", "slime")
