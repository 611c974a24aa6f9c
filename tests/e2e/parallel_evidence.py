"""Evidence readers shared by the parallel-equivalence tests of slime's loop (``test_slime_parallel_*.py``): the
tensors of a weight version slime pushed, compared byte for byte."""

from __future__ import annotations

import subprocess
import sys
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


def quantize(src: Path, out: Path, fmt: str, *options: str) -> Path:
    """``slime-ascend quantize SRC OUT --format FMT [OPTIONS]``, the command a user runs; returns ``out``."""
    done = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "quantize", str(src), str(out), "--format", fmt,
                           *options], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def first_push_reference(model_dir: Path, root: Path, fmt: str) -> Path:
    """What a job's first quantised push must equal: ``slime-ascend quantize`` of the loaded weights in the fp32 the
    job trains and pushes them in (:func:`fp32_copy`), under ``root``."""
    return quantize(fp32_copy(model_dir, root / "fp32"), root / f"fp32-{fmt}", fmt)


def assert_samples_alike(ref: dict, got: dict, tolerances: dict, rollout_id: int) -> None:
    """One rollout's samples of slime's train dump (``{position: sample}``) in a layout (``got``) against the
    one-rank run's (``ref``): the same samples, the same tokens, and each field of ``tolerances`` equal (None:
    exactly) or within its absolute tolerance."""
    import torch

    assert sorted(got) == sorted(ref) and ref, (rollout_id, sorted(got), sorted(ref))
    for position, sample in ref.items():
        assert torch.equal(torch.as_tensor(got[position]["tokens"]), torch.as_tensor(sample["tokens"])), \
            (rollout_id, position)  # the same rollout: the engine served the same weights
        for key, atol in tolerances.items():
            want, have = torch.as_tensor(sample[key]).float(), torch.as_tensor(got[position][key]).float()
            if atol is None:
                assert torch.equal(have, want), (rollout_id, position, key, have, want)
            else:
                torch.testing.assert_close(have, want, rtol=0, atol=atol, msg=lambda m: f"{key} "
                                           f"(rollout {rollout_id}, sample {position}): {m}")


def hf_weights(model_dir: Path) -> dict:
    """Every tensor of an HF safetensors checkpoint (or of a weight push slime wrote)."""
    from safetensors.torch import load_file

    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(path)))
    assert out, f"no safetensors tensors in {model_dir}"
    return out


def read_dist_checkpoint(root: Path) -> dict:
    """The model tensors of the newest Megatron torch_dist checkpoint slime saved under ``root`` (``--save``),
    whole (every TP shard and every EP rank's experts put together by torch.distributed.checkpoint), by Megatron's
    sharded key (``decoder.layers.1.mlp.experts.experts.linear_fc1.weight``: all experts, ``[experts, out, in]``);
    the optimizer's state (whose buffers differ between layouts) is left out."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    latest = (Path(root) / "latest_checkpointed_iteration.txt").read_text().strip()
    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(Path(root) / f"iter_{int(latest):07d}")),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    # the optimizer's buffers: "optimizer...." or, for an MoE model's dense and expert optimizers,
    # "chained_<i>.optimizer...."
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and "optimizer" not in k.split(".")}


def attention_from_hf(hf: dict, layer: int, heads: int = 4, groups: int = 2, head_dim: int = 16) -> dict:
    """Megatron name -> the HF tensor it is loaded from, for the attention of one layer of the tiny Qwen3 (dense or
    MoE: the same attention): the fused GQA ``linear_qkv`` (per group: its q heads, k, v), its fused input norm,
    the output projection and the q/k norms."""
    import torch

    p = f"model.layers.{layer}.self_attn."
    q = hf[p + "q_proj.weight"].view(groups, heads // groups * head_dim, -1)
    k = hf[p + "k_proj.weight"].view(groups, head_dim, -1)
    v = hf[p + "v_proj.weight"].view(groups, head_dim, -1)
    m = f"decoder.layers.{layer}.self_attention."
    return {
        m + "linear_qkv.weight": torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1]),
        m + "linear_qkv.layer_norm_weight": hf[f"model.layers.{layer}.input_layernorm.weight"],
        m + "linear_proj.weight": hf[p + "o_proj.weight"],
        m + "q_layernorm.weight": hf[p + "q_norm.weight"],
        m + "k_layernorm.weight": hf[p + "k_norm.weight"],
    }


def experts_from_hf(hf: dict, layer: int, experts: int) -> dict:
    """Megatron's expert tensors of one MoE layer (``[experts, out, in]``, as :func:`read_dist_checkpoint` gives
    them) built from the HF per-expert projections: fc1 = gate and up stacked, fc2 = down."""
    import torch

    p = f"model.layers.{layer}.mlp.experts."
    m = f"decoder.layers.{layer}.mlp.experts.experts."
    return {
        m + "linear_fc1.weight": torch.stack([torch.cat([hf[f"{p}{e}.gate_proj.weight"], hf[f"{p}{e}.up_proj.weight"]])
                                              for e in range(experts)]),
        m + "linear_fc2.weight": torch.stack([hf[f"{p}{e}.down_proj.weight"] for e in range(experts)]),
    }


def fp8_code_steps(got, want):
    """How many e4m3 codes apart two float8_e4m3fn tensors are, element by element (0: the same value; 1: the next
    representable value). The format's 7 magnitude bits order its values, so a code's signed magnitude is its place
    on the number line (+0 and -0 both at 0)."""
    import torch

    def place(t):
        bits = t.contiguous().view(torch.uint8).to(torch.int16)
        magnitude = bits & 0x7F
        return torch.where(bits >= 0x80, -magnitude, magnitude)

    return (place(got) - place(want)).abs().to(torch.int64)


def assert_quantised_close(pushed: Path, reference: Path, *, rtol: float, atol: float, max_flipped: float) -> dict:
    """Two quantised weight pushes of trained weights (fp32 summed in another order): the same names, dtypes and
    shapes; unquantised tensors and scales within ``rtol`` / ``atol``; fp8 codes the same except codes that moved
    by one e4m3 step (a weight that lay on a rounding boundary), at most ``max_flipped`` of all codes. Returns
    ``{"codes": n, "flipped": n, "worst": (name, max |difference|) of the unquantised tensors}``."""
    import torch

    got, want = hf_weights(pushed), hf_weights(reference)
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    codes = flipped = 0
    worst = ("", 0.0)
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), (name, g.dtype, g.shape, w.dtype, w.shape)
        if w.dtype == torch.float8_e4m3fn:
            steps = fp8_code_steps(g, w)
            assert int(steps.max()) <= 1, f"{name}: fp8 codes {int(steps.max())} steps apart"
            codes, flipped = codes + steps.numel(), flipped + int((steps > 0).sum())
        else:
            torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
            gap = float((g.float() - w.float()).abs().max()) if w.numel() else 0.0
            worst = max(worst, (name, gap), key=lambda x: x[1])
    assert codes > 0, f"no fp8 tensor in {reference}"
    assert flipped <= max_flipped * codes, (flipped, codes)
    return {"codes": codes, "flipped": flipped, "worst": worst}


def dis_decisions(samples: dict, eps_low: float, eps_high: float) -> dict:
    """The ``dis`` plugin's keep decision for every trainable token of every dumped sample (slime's
    ``--save-debug-train-data`` samples by key): its own band test (``algorithms.masks.in_dis_band``) on
    w = exp(train-side old log-prob - engine log-prob), as ``offpolicy.tis.dis_apply`` computes it."""
    import torch

    from slime_ascend.algorithms.masks import in_dis_band, log_ratio

    out = {}
    for key, s in samples.items():
        lp, rlp = torch.as_tensor(s["log_probs"]).float(), torch.as_tensor(s["rollout_log_probs"]).float()
        keep = in_dis_band(torch.exp(log_ratio(lp, rlp)), eps_low, eps_high)
        out[key] = keep | ~torch.as_tensor(s["loss_masks"]).bool()  # untrained tokens: nothing to mask
    return out


def band_margin(samples: dict, eps_low: float, eps_high: float) -> float:
    """The smallest distance, in log-ratio, of a trainable token's log w to the band's edges log(1 - eps_low),
    log(1 + eps_high): a layout whose log-probs move by less keeps every decision."""
    import math

    import torch

    edges = torch.tensor([math.log1p(-eps_low), math.log1p(eps_high)], dtype=torch.float64)
    gaps = []
    for s in samples.values():
        d = (torch.as_tensor(s["log_probs"]).double() - torch.as_tensor(s["rollout_log_probs"]).double())
        d = d[torch.as_tensor(s["loss_masks"]).bool()]
        if d.numel():
            gaps.append((d[:, None] - edges[None, :]).abs().min())
    return float(min(gaps))


def one_cp_shard_only(decisions: dict, samples: dict, cp_size: int = 2, rank: int = 0) -> dict:
    """``decisions`` as a DIS mask computed on CP rank ``rank``'s shard only would leave them: the tokens slime's
    zig-zag split gives the other CP ranks keep (nothing masked there). The broken evidence the comparison of
    :func:`assert_same_decisions` must refuse."""
    from slime_ascend.algorithms.cp import cp_response_ranges

    out = {}
    for key, keep in decisions.items():
        s = samples[key]
        own = keep.clone().fill_(False)
        for a, b in cp_response_ranges(rank, cp_size, int(s["total_lengths"]), int(s["response_lengths"])):
            own[a:b] = True
        out[key] = keep | ~own
    return out


def assert_same_decisions(got: dict, want: dict) -> tuple[int, int]:
    """The same keep decision for every token of every sample; returns (kept, masked) trainable-or-not tokens."""
    import torch

    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    kept = masked = 0
    for key, w in want.items():
        assert torch.equal(got[key], w), (key, got[key], w)
        kept, masked = kept + int(w.sum()), masked + int((~w).sum())
    return kept, masked


def train_ranks(run, role: str = "actor") -> int:
    """Train processes slime started for ``role`` (actor or critic): one device line each
    (train.validate_at_actor_init)."""
    return run.log.count(f"slime accelerator in the {role} train actor")


def megatron_args(run, name: str) -> set[str]:
    """``name``'s values in Megatron's argument dumps (``_print_args`` after ``validate_args``, the driver's and any
    other process's: the name, dots to column 48, the value)."""
    import re

    found = set(re.findall(rf"\b{name} \.+ (\S+)$", run.log, re.MULTILINE))
    assert found, f"{name} not in Megatron's argument dump"
    return found


def pushes(work: Path) -> list[Path]:
    """The weight versions a job pushed over disk (``work/weights``, kept by ``--update-weight-disk-keep-files``)."""
    return sorted(p for p in (Path(work) / "weights").iterdir() if p.is_dir())


OPD_COEFS = {"math": 1.0, "code": 0.5}  # two teachers on one teacher engine, routed by the prompt's domain


def opd_settings(teacher: Path, mode: str, url: str | None = None, **extra) -> dict:
    """opd's settings for two teachers (:data:`OPD_COEFS`, routed by the prompt's ``domain``) served from one
    checkpoint (``teacher``; at ``url`` when given), no switch engine, the reward (``parity_reward.reward``) through
    opd's task reward path, in ``mode``; ``extra`` settings added."""
    teachers = [{"name": name, "checkpoint_dir": str(teacher), "domains": [name], "coef": coef,
                 **({"url": url} if url is not None else {})} for name, coef in OPD_COEFS.items()]
    return {"ascend_opd_teachers": teachers, "ascend_opd_domain_key": "domain", "ascend_opd_switch_engine_urls": [],
            "ascend_opd_task_rm_path": "parity_reward.reward", "ascend_opd_mode": mode, **extra}
