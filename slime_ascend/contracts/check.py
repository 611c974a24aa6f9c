"""Engine of ``slime-ascend check``: numeric train/rollout contracts measured on a small causal LM.

What it does, in order:
    1. Builds a tiny random Qwen3 causal LM (vocab 1024, hidden 64, 2 layers; no download) or loads
       ``model_dir`` (safetensors only, local files only).
    2. Feeds fixed random token IDs and computes per-token log-probs of those same IDs (next-token,
       log-softmax in fp32) along numeric paths: ``fp32`` (reference, the "trainer"), ``bf16`` (whole
       model cast to bfloat16), ``int8`` (fp32 model whose Linear weights, lm_head excluded, are
       fake-quantised to symmetric per-output-channel INT8).
    3. For each non-reference path (the "rollout"), Δ = logp_fp32 - logp_path: mismatch statistics
       (:mod:`slime_ascend.algorithms.mismatch`) and the DIS (GLM-5 preset) / IcePop (beta 2) masked
       fractions.
    4. Checks deterministic top-k (:mod:`slime_ascend.algorithms.topk`) on tie-heavy scores: repeat
       calls, 1 vs N threads, a stable-sort reference, index replay, and ``device`` vs CPU.
    5. DSA indexer top-k (:mod:`slime_ascend.algorithms.dsa_topk`, what the ``dsa-determinism`` plugin puts
       in slime's indexer): index-set agreement between two numeric paths of a lightning indexer
       (causal, sum over heads of relu(q.k) * w): the key-sharded merge vs the unsharded top-k (must be
       identical), ``device`` vs CPU on the same scores (identical), and bf16 vs fp32 indexer inputs (fraction of query rows with identical index sets and
       mean Jaccard, lower bounds :data:`DSA_TOPK_THRESHOLDS`).

Thresholds (:data:`DEFAULT_THRESHOLDS`) were calibrated on the tiny model (initializer_range 0.1, so
log-probs have a std of ~0.8 rather than the near-uniform 0.17 of the default 0.02), seeds 0-2, on CPU:
    bf16:  |Δ| mean 0.008-0.009, p99 0.030-0.034, max 0.05; DIS/IcePop masked 0.
    int8:  |Δ| mean 0.013-0.015, max 0.07; DIS/IcePop masked 0.
Bounds are ~3x the worst measurement for means/p99s; masked fractions allow 1% (DIS, GLM-5 band
(0.8, 1.28) needs |Δ| >= 0.22) and 0.1% (IcePop, |Δ| >= 0.69; Ring-1T reports 1-2 per mille on real
models). A real model (``model_dir``) can differ; pass ``thresholds=`` to override.

DSA top-k bounds (:data:`DSA_TOPK_THRESHOLDS`) come from the distribution of the bf16-vs-fp32 agreement at
the check's indexer shape (:data:`DSA_SHAPE`: 512 causal queries, 8 heads of dim 32, k = 64, so the first 64
rows select every key), measured by ``benchmarks/calibrate_dsa_agreement.py`` over seeds 0-199 on CPU
(Intel Xeon, AVX-512): rows with identical index sets min 0.832, 5% quantile 0.848, median 0.873, max
0.912, sd 0.015; mean Jaccard min 0.9948, 5% quantile 0.9953, median 0.9960, sd 0.00047 (a differing row
swaps 1-2 of its 64 keys). Each bound is that minimum minus 3 sd, rounded down: 0.78 and 0.993. They
catch a perturbed score smaller than one bf16 step: N(0, (0.005 std)^2) noise on the bf16 scores (std ~4,
so ~0.02, where a bf16 step at a score of 4 is 0.031; the ``dsa_bf16_noise`` fault) gives rows 0.69-0.77 and Jaccard 0.9895-0.9926 over seeds 0-49, below both
bounds on every seed (the earlier bounds 0.6 / 0.98 passed it on every seed). Another shape or a device
whose bf16 matmul rounds differently has its own distribution (2048 queries with k = 256: rows 0.57-0.60,
Jaccard 0.9962-0.9965 over seeds 0-19): measure it with the script (``--device``) and pass ``dsa_thresholds=``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from slime_ascend.algorithms.dsa_topk import deterministic_topk, index_set_agreement, sharded_deterministic_topk
from slime_ascend.algorithms.masks import DIS_PRESETS, dis_mask, icepop_weights
from slime_ascend.algorithms.mismatch import mismatch_stats
from slime_ascend.algorithms.topk import deterministic_topk_indices, replay_topk_indices
from slime_ascend.rollout.torch_engine.model import TINY_QWEN3_KWARGS

__all__ = [
    "DEFAULT_THRESHOLDS",
    "DSA_SHAPE",
    "DSA_TOPK_THRESHOLDS",
    "INJECTIONS",
    "ContractResult",
    "CheckReport",
    "dsa_bf16_agreement",
    "run_check",
    "format_table",
    "fake_quant_int8_per_channel",
]

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

#: Upper bounds per path: statistic name -> bound (see module docstring for how they were chosen).
DEFAULT_THRESHOLDS: dict[str, dict[str, float]] = {
    "bf16": {"logratio_abs_mean": 0.03, "logratio_abs_p99": 0.1, "dis_masked_frac": 0.01, "icepop_masked_frac": 0.001},
    "int8": {"logratio_abs_mean": 0.05, "logratio_abs_p99": 0.2, "dis_masked_frac": 0.01, "icepop_masked_frac": 0.001},
}

#: Lower bounds of the DSA indexer's bf16-vs-fp32 index-set agreement (see module docstring).
DSA_TOPK_THRESHOLDS: dict[str, float] = {"rows_identical_frac": 0.78, "jaccard_mean": 0.993}

#: The DSA indexer case of ``slime-ascend check``: (queries = keys, heads, head dim, k).
DSA_SHAPE: tuple[int, int, int, int] = (512, 8, 32, 64)

#: Deliberate faults for self-tests of the checker: each must turn some contract to FAIL.
#:   logprob_noise: add N(0, 0.5²) to the bf16 path's log-probs.
#:   logprob_nan:   put a NaN into the bf16 path's log-probs.
#:   topk_unstable: top-k under test breaks ties by *highest* index on every other call.
#:   dsa_merge_unstable: the key-sharded DSA top-k merges ties by *highest* index.
#:   dsa_bf16_noise: the bf16 DSA indexer path's scores get N(0, (0.005 std)²) noise (std: the scores').
INJECTIONS = ("logprob_noise", "logprob_nan", "topk_unstable", "dsa_merge_unstable", "dsa_bf16_noise")

# the torch engine's tiny model, with a shorter context and a wider init (the default init gives
# near-uniform log-probs, which would make every numeric path look alike)
_TINY = dict(TINY_QWEN3_KWARGS, max_position_embeddings=256, initializer_range=0.1)
_DIS_PRESET = "glm5"
_ICEPOP_BETA = 2.0
# the dsa_bf16_noise fault: N(0, (_DSA_FAULT_NOISE * std)^2) on the bf16 indexer scores (see the module docstring)
_DSA_FAULT_NOISE = 0.005


@dataclass
class ContractResult:
    """One named contract: ``value`` compared against ``threshold`` (a human-readable rule)."""

    name: str
    status: str
    value: Any
    threshold: str
    detail: str = ""


@dataclass
class CheckReport:
    contracts: list[ContractResult] = field(default_factory=list)
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True iff no contract FAILed (SKIPs allowed)."""
        return all(c.status != FAIL for c in self.contracts)

    def contract(self, name: str) -> ContractResult:
        for c in self.contracts:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(
            {
                "passed": self.passed,
                "contracts": [asdict(c) for c in self.contracts],
                "stats": self.stats,
                "meta": self.meta,
            }
        )


def _json_safe(x: Any) -> Any:
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, Mapping):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def fake_quant_int8_per_channel(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric per-output-channel INT8 fake quant of a [out, in] weight (returned in its dtype).

    The Ascend W8A8 rule of :mod:`slime_ascend.quant` (the same function the weight sync and the
    offline converter use), so the contract measures what the rollout engine will run.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    from ..quant import fake_quantize_values, make_spec

    return fake_quantize_values(weight.detach(), make_spec("int8-w8a8")).to(weight.dtype)


# --------------------------------------------------------------------------------------------------
# model and log-probs


def _build_model(model_dir: str | None, seed: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    if model_dir is None:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(Qwen3Config(**_TINY))
        info = {k: _TINY[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers")}
        return model.float().eval(), {"model": "tiny-random-qwen3", **info}
    if not os.path.isdir(model_dir):
        raise ValueError(f"model_dir {model_dir!r} is not a directory")
    if not any(f.endswith(".safetensors") for f in os.listdir(model_dir)):
        raise ValueError(f"model_dir {model_dir!r} has no *.safetensors file (pickle checkpoints are not loaded)")
    from ..opd.safetensors_dir import validate_safetensors_dir

    try:  # each shard's header read first: a truncated or foreign file is named, not a loader's bare error
        validate_safetensors_dir(model_dir)
    except ValueError as exc:
        raise ValueError(f"--model: {exc}. Fix: write or download the checkpoint again") from None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, use_safetensors=True, local_files_only=True, dtype=torch.float32
    )
    return model.eval(), {"model": os.path.abspath(model_dir), "vocab_size": int(model.config.vocab_size)}


def _token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t] | ids[:, :t]) for t >= 1, shape [B, T-1], fp32."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _int8_model(model: torch.nn.Module) -> torch.nn.Module:
    q = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in q.named_modules():
            if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
                mod.weight.copy_(fake_quant_int8_per_channel(mod.weight))
    return q


# --------------------------------------------------------------------------------------------------
# contracts


def _bound(name: str, value: float, bound: float, detail: str = "") -> ContractResult:
    ok = value is not None and math.isfinite(value) and value <= bound
    return ContractResult(name, PASS if ok else FAIL, value, f"<= {bound:g}", detail)


def _device_matches_cpu(family: str, device: torch.device, same: Callable[[], bool]) -> ContractResult:
    """``<family>.device_matches_cpu``: ``same()`` compares ``device``'s result with the CPU's (SKIP on the CPU)."""
    name = f"{family}.device_matches_cpu"
    if device.type == "cpu":
        return ContractResult(name, SKIP, None, "== CPU result", "device is cpu")
    ok = same()
    return ContractResult(name, PASS if ok else FAIL, ok, "== CPU result", str(device))


def _unstable_topk() -> Callable[[torch.Tensor, int], torch.Tensor]:
    calls = [0]

    def topk(scores: torch.Tensor, k: int) -> torch.Tensor:
        calls[0] += 1
        if calls[0] % 2:
            return deterministic_topk_indices(scores, k)
        length = scores.shape[-1]
        rev = deterministic_topk_indices(scores.flip(-1), k)  # lowest index of the flipped = highest here
        key = torch.where(rev >= 0, length - 1 - rev, torch.full_like(rev, length)).sort(-1).values
        return torch.where(key == length, torch.full_like(key, -1), key)

    return topk


def _stable_sort_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Independent reference (DESIGN.md "Numerical conventions", top-k): stable descending sort, first k, ascending."""
    length = scores.shape[-1]
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    valid = scores.gather(-1, order) != float("-inf")
    key = torch.where(valid, order, torch.full_like(order, length)).sort(-1).values
    out = torch.where(key == length, torch.full_like(key, -1), key)
    if k > length:
        pad = torch.full((*scores.shape[:-1], k - length), -1, dtype=torch.long, device=scores.device)
        out = torch.cat([out, pad], dim=-1)
    return out


def _topk_contracts(device: torch.device, seed: int, topk_fn, rows: int, length: int, k: int) -> list[ContractResult]:
    g = torch.Generator().manual_seed(seed + 1)
    # bf16-rounded Gaussian scores (many ties near the threshold) with a causal-like -inf tail.
    scores = torch.randn(rows, length, generator=g).to(torch.bfloat16).float()
    for r in range(rows):
        scores[r, length - r * (length // (2 * rows)) :] = float("-inf")
    scores[0, :] = 0.0  # a row of nothing but ties
    out: list[ContractResult] = []

    first = topk_fn(scores, k)
    repeats = [topk_fn(scores, k) for _ in range(4)]
    same = all(torch.equal(first, r) for r in repeats)
    out.append(ContractResult("topk.repeat_identical", PASS if same else FAIL, same, "== across 5 calls"))

    before = torch.get_num_threads()
    n_many = max(2, before)
    try:
        torch.set_num_threads(1)
        one = topk_fn(scores, k)
        torch.set_num_threads(n_many)
        many = topk_fn(scores, k)
    finally:
        torch.set_num_threads(before)
    same = torch.equal(one, many)
    out.append(ContractResult("topk.threads_identical", PASS if same else FAIL, same, f"== at 1 and {n_many} threads"))

    ref = _stable_sort_topk(scores, k)
    same = torch.equal(first, ref) and torch.equal(many, ref)
    out.append(ContractResult("topk.matches_stable_sort", PASS if same else FAIL, same, "== stable-sort reference"))

    try:
        replayed = replay_topk_indices(first, k, length)
        same, detail = torch.equal(replayed, first), ""
    except ValueError as e:
        same, detail = False, str(e)
    out.append(ContractResult("topk.replay_roundtrip", PASS if same else FAIL, same, "== after validation", detail))

    out.append(_device_matches_cpu("topk", device, lambda: torch.equal(topk_fn(scores.to(device), k).cpu(), first)))
    return out


def _indexer_logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores [T, S] in fp32: sum_h relu(q[t, h] . k[s]) * w[t, h], causal (-inf above the
    diagonal), the formula of slime's GLM-5 indexer kernel. q . k comes out in the inputs' dtype (bf16 inputs:
    rounded to bf16), the weighted sum over heads is taken in fp32."""
    s = torch.einsum("thd,sd->ths", q, k).float()
    logits = (s.clamp(min=0) * w.float()[..., None]).sum(1)
    causal = torch.ones(logits.shape, dtype=torch.bool, device=logits.device).tril()
    return logits.masked_fill(~causal, float("-inf"))


def _unstable_sharded_topk(scores: torch.Tensor, k: int, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Fault: the sharded path with ties by highest index (the merge of the key-reversed scores, mapped back)."""
    length = scores.shape[-1]
    values, idx = sharded_deterministic_topk(scores.flip(-1), k, sizes[::-1])
    return values, torch.where(idx >= 0, length - 1 - idx, idx)


def _dsa_device_matches_cpu(device: torch.device, cpu_scores: torch.Tensor, k: int, sizes: list[int]) -> bool:
    """The DSA top-k (unsharded and merged) of the same scores on ``device`` equals the CPU's: on the scores and
    on a coarse grid of them with alternate rows negated (ties everywhere, -0.0 next to +0.0)."""
    sign = torch.where(torch.arange(cpu_scores.shape[0]) % 2 == 0, 1.0, -1.0)[:, None]
    same = True
    for scores in (cpu_scores, torch.round(cpu_scores * 2) / 2 * sign):
        want = deterministic_topk(scores, k)
        for got in (deterministic_topk(scores.to(device), k), sharded_deterministic_topk(scores.to(device), k, sizes)):
            same = same and torch.equal(got[1].cpu(), want[1]) and torch.equal(got[0].cpu(), want[0])
    return same


def _dsa_inputs(seed: int, shape: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer's fp32 inputs for ``seed``: queries [T, H, D], keys [T, D], head weights [T, H]."""
    n, heads, dim, _ = shape
    g = torch.Generator().manual_seed(seed + 3)
    q = torch.randn(n, heads, dim, generator=g)
    key = torch.randn(n, dim, generator=g)
    w = torch.randn(n, heads, generator=g) / heads ** 0.5
    return q, key, w


def dsa_bf16_agreement(seed: int, shape: tuple[int, int, int, int] = DSA_SHAPE, device: str | torch.device = "cpu",
                       score_noise: float = 0.0) -> dict[str, float]:
    """Index-set agreement (:func:`~slime_ascend.algorithms.dsa_topk.index_set_agreement`) of the deterministic
    top-k of the indexer on fp32 inputs and on the same inputs rounded to bf16, for ``seed`` at ``shape``
    (queries = keys, heads, head dim, k): what ``dsa_topk.bf16_vs_fp32.*`` bounds. ``score_noise`` > 0 is a
    fault for self-tests and calibration: the bf16 path's scores get N(0, (score_noise * std)^2) noise, std the
    fp32 scores' standard deviation over the causal entries."""
    dev = torch.device(device)
    q, key, w = (t.to(dev) for t in _dsa_inputs(seed, shape))
    fp32 = _indexer_logits(q, key, w)
    bf16 = _indexer_logits(q.bfloat16(), key.bfloat16(), w.bfloat16())
    if score_noise:
        std = fp32[torch.isfinite(fp32)].std()
        noise = torch.randn(bf16.shape, generator=torch.Generator().manual_seed(seed + 4)).to(dev)
        bf16 = bf16 + score_noise * std * noise
    k = shape[3]
    return index_set_agreement(deterministic_topk(fp32, k)[1].cpu(), deterministic_topk(bf16, k)[1].cpu())


def _dsa_topk_contracts(device: torch.device, seed: int, shape: tuple[int, int, int, int],
                        bounds: Mapping[str, float], inject: str | None,
                        stats: dict[str, dict[str, float]]) -> list[ContractResult]:
    n, heads, dim, k = shape
    q, key, w = _dsa_inputs(seed, shape)
    out: list[ContractResult] = []

    # 1) key-sharded merge vs unsharded: uneven shards (one empty), on the fp32 scores and on a coarse
    #    grid of them (ties everywhere); values and indices must be identical row by row.
    fp32 = _indexer_logits(q.to(device), key.to(device), w.to(device))
    sizes = [n // 7, n // 3, 0, n - n // 7 - n // 3]
    merge = _unstable_sharded_topk if inject == "dsa_merge_unstable" else sharded_deterministic_topk
    same_rows, rows = 0, 0
    for scores in (fp32, torch.round(fp32 * 2) / 2):
        whole_v, whole_i = deterministic_topk(scores, k)
        got_v, got_i = merge(scores, k, sizes)
        same = (got_i == whole_i).all(-1) & ((got_v == whole_v) | (got_i < 0)).all(-1)
        same_rows += int(same.sum())
        rows += int(same.numel())
    frac = same_rows / rows
    out.append(ContractResult("dsa_topk.sharded_merge_identical", PASS if frac == 1.0 else FAIL, frac,
                              "== 1 (rows identical)", f"shards {sizes} of {n} keys, k={k}, {rows} rows"))

    # 2) the same scores on ``device`` and on the CPU (incl. ties and ±0 on the grid): identical selection,
    #    unsharded and merged (a CUDA sort orders float bits, so -0.0 vs +0.0 is where it could differ).
    out.append(_device_matches_cpu("dsa_topk", device,
                                   lambda: _dsa_device_matches_cpu(device, _indexer_logits(q, key, w), k, sizes)))

    # 3) bf16 vs fp32 indexer inputs: index-set agreement of the deterministic top-k.
    agreement = dsa_bf16_agreement(seed, shape, device, _DSA_FAULT_NOISE if inject == "dsa_bf16_noise" else 0.0)
    stats["dsa_topk_bf16"] = agreement
    for stat in ("rows_identical_frac", "jaccard_mean"):
        value, bound = agreement[stat], bounds[stat]
        ok = math.isfinite(value) and value >= bound
        out.append(ContractResult(f"dsa_topk.bf16_vs_fp32.{stat}", PASS if ok else FAIL, value, f">= {bound:g}",
                                  f"{n} queries, {heads} heads, dim {dim}, k={k}"))
    return out


def run_check(
    model_dir: str | None = None,
    device: str = "cpu",
    seed: int = 0,
    out_json: str | None = None,
    plot: str | None = None,
    *,
    batch: int = 4,
    seq_len: int = 64,
    thresholds: Mapping[str, Mapping[str, float]] | None = None,
    inject: str | None = None,
    topk_shape: tuple[int, int, int] = (8, 8192, 512),
    dsa_shape: tuple[int, int, int, int] = DSA_SHAPE,
    dsa_thresholds: Mapping[str, float] | None = None,
) -> CheckReport:
    """Run all contracts; optionally write JSON (``out_json``) and a log-ratio histogram PNG (``plot``).

    Args:
        model_dir: local HF model directory with safetensors weights; None builds the tiny random model.
        device: torch device string for the model and the device top-k comparison.
        seed: seeds model init, token IDs and top-k scores (caller's RNG state is left untouched).
        batch, seq_len: token-ID batch shape.
        thresholds: per-path overrides merged into :data:`DEFAULT_THRESHOLDS`.
        inject: one of :data:`INJECTIONS` (tests only).
        topk_shape: (rows, L, k) of the top-k determinism case.
        dsa_shape: (queries = keys, heads, head dim, k) of the DSA indexer top-k case.
        dsa_thresholds: overrides of :data:`DSA_TOPK_THRESHOLDS` (lower bounds).
    """
    if inject is not None and inject not in INJECTIONS:
        raise ValueError(f"inject must be None or one of {INJECTIONS}, got {inject!r}")
    if batch < 1 or seq_len < 2:
        raise ValueError(f"need batch >= 1 and seq_len >= 2, got batch={batch}, seq_len={seq_len}")
    t0 = time.perf_counter()
    dev = torch.device(device)
    limits = {p: dict(v) for p, v in DEFAULT_THRESHOLDS.items()}
    for p, v in (thresholds or {}).items():
        if p not in limits:
            raise ValueError(f"thresholds has unknown path {p!r}; known: {sorted(limits)}")
        limits[p].update(v)
    dsa_bounds = dict(DSA_TOPK_THRESHOLDS)
    for stat, v in (dsa_thresholds or {}).items():
        if stat not in dsa_bounds:
            raise ValueError(f"dsa_thresholds has unknown statistic {stat!r}; known: {sorted(dsa_bounds)}")
        dsa_bounds[stat] = float(v)

    model, meta = _build_model(model_dir, seed)
    vocab = int(meta["vocab_size"])
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed)).to(dev)

    paths: dict[str, torch.Tensor] = {}
    paths["fp32"] = _token_logprobs(model.to(dev), ids)
    paths["bf16"] = _token_logprobs(copy.deepcopy(model).to(dev, torch.bfloat16), ids)
    paths["int8"] = _token_logprobs(_int8_model(model).to(dev), ids)
    if inject == "logprob_noise":
        g = torch.Generator().manual_seed(seed + 2)
        paths["bf16"] = paths["bf16"] + 0.5 * torch.randn(paths["bf16"].shape, generator=g).to(dev)
    elif inject == "logprob_nan":
        paths["bf16"] = paths["bf16"].clone()
        paths["bf16"][0, 0] = float("nan")

    report = CheckReport(meta={**meta, "device": str(dev), "seed": seed, "batch": batch, "seq_len": seq_len,
                               "torch": torch.__version__, "inject": inject,
                               "dis_band": list(DIS_PRESETS[_DIS_PRESET]), "icepop_beta": _ICEPOP_BETA,
                               "int8_fake_quant": "int8-w8a8 per output channel (slime_ascend.quant)"})
    bad = [p for p, t in paths.items() if not bool(torch.isfinite(t).all())]
    report.contracts.append(ContractResult("logprobs.finite", FAIL if bad else PASS, not bad, "all paths finite",
                                           f"non-finite: {bad}" if bad else ""))

    ref = paths["fp32"]
    deltas: dict[str, torch.Tensor] = {}
    train = [r.cpu() for r in ref]
    masks = [torch.ones_like(r, dtype=torch.bool) for r in train]
    for path in ("bf16", "int8"):
        lp = paths[path]
        roll = [r.cpu() for r in lp]
        dis_keep = [dis_mask(a, b, *DIS_PRESETS[_DIS_PRESET]) for a, b in zip(train, roll)]
        ice_keep = [icepop_weights(a, b, _ICEPOP_BETA)[1] for a, b in zip(train, roll)]
        stats = mismatch_stats(train, roll, masks, dis_keep)
        stats["dis_masked_frac"] = stats.pop("masked_frac")
        stats["icepop_masked_frac"] = mismatch_stats(train, roll, masks, ice_keep)["masked_frac"]
        report.stats[path] = stats
        deltas[path] = (ref - lp).flatten().cpu()
        for stat, bound in limits[path].items():
            report.contracts.append(_bound(f"{path}_vs_fp32.{stat}", stats[stat], bound))

    rows, length, k = topk_shape
    topk_fn = _unstable_topk() if inject == "topk_unstable" else deterministic_topk_indices
    report.contracts.extend(_topk_contracts(dev, seed, topk_fn, rows, length, k))
    report.meta["topk_shape"] = list(topk_shape)
    report.contracts.extend(_dsa_topk_contracts(dev, seed, tuple(dsa_shape), dsa_bounds, inject, report.stats))
    report.meta["dsa_shape"] = list(dsa_shape)
    report.meta["elapsed_s"] = round(time.perf_counter() - t0, 3)

    from ..files import write_file  # a full disk: one line naming the file

    if out_json is not None:
        write_file(out_json, json.dumps(report.to_dict(), indent=2, allow_nan=False))
    if plot is not None:
        write_file(plot, _plot(deltas))
    return report


def _plot(deltas: Mapping[str, torch.Tensor]) -> bytes:
    """The log-ratio histogram as PNG bytes (written by the caller: matplotlib's own writer can lose an error)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, d in deltas.items():
        d = d[torch.isfinite(d)]
        ax.hist(d.numpy(), bins=80, histtype="step", label=f"fp32 - {name}")
    ax.set_xlabel("log-ratio  logp_train(fp32) - logp_rollout(path)")
    ax.set_ylabel("tokens")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def format_table(report: CheckReport) -> str:
    """Plain-text table: one row per contract, then a one-line verdict."""
    rows = [("contract", "status", "value", "threshold")]
    for c in report.contracts:
        if isinstance(c.value, float):
            val = f"{c.value:.3g}"
        else:
            val = "-" if c.value is None else str(c.value)
        rows.append((c.name, c.status, val, c.threshold))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    n_fail = sum(c.status == FAIL for c in report.contracts)
    verdict = "ALL PASS" if n_fail == 0 else f"{n_fail} FAIL"
    lines.append(f"{verdict} ({report.meta.get('model', '?')}, device={report.meta.get('device', '?')}, "
                 f"{report.meta.get('elapsed_s', '?')}s)")
    return "\n".join(lines)
