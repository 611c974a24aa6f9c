"""The checkpoint formats and INT4 numerics by name (no torch: the CLI's parser reads them)."""

FP8_BLOCK = "fp8-block"
INT8_W8A8 = "int8-w8a8"
INT8_CT = "int8-ct"
INT4_GROUP = "int4-group"
FORMATS: tuple[str, ...] = (FP8_BLOCK, INT8_W8A8, INT8_CT, INT4_GROUP)

INT4_NUMERICS: tuple[str, ...] = ("compressed-tensors", "torchao", "slime")
