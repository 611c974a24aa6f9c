"""The torch engine: a tiny Qwen3-shaped model (model) served on SGLang's HTTP surface (engine).

Importing this package imports neither torch nor transformers (``slime-ascend serve-torch --help``
reads the limits below without them).
"""

# Per-request limits (TorchEngine's constructor args; ``slime-ascend serve-torch --max-batch-size`` etc.).
DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_MAX_PROMPT_TOKENS = 131072
DEFAULT_MAX_NEW_TOKENS_LIMIT = 16384
# Most top-k log-prob entries one answer may hold (top_logprobs_num x scored and new positions, over a batch):
# the answer's size is bounded like the request's (about 30 bytes of JSON an entry; OPD's top-32 over 8 x 4k tokens
# is 1M entries)
DEFAULT_MAX_TOP_LOGPROBS = 1 << 22
# Most values one /get_weights_by_name answer may hold (weight_read.py; about 80 MB of JSON at most)
DEFAULT_MAX_WEIGHT_VALUES = 1 << 22
