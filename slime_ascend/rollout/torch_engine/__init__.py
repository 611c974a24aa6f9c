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
# Most bytes one /get_weights_by_name answer may take (weight_read.py: its worst-case JSON size, checked before it
# is built; 100 rows of a 7168-wide GLM-5 embedding take 18 MB), and most bytes of such answers being built or sent
# at once, over all connections (a client that never reads holds its answer's bytes until --timeout)
DEFAULT_MAX_WEIGHT_ANSWER_BYTES = 32 << 20
DEFAULT_MAX_WEIGHT_BYTES_IN_FLIGHT = 128 << 20
