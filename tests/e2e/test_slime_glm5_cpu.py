"""slime's own ``train.py`` on this CPU with slime's own GLM-5 spec (``slime_plugins.models.glm5.glm5
get_glm5_spec``: MLA, DSA with IndexShare, MoE with a shared expert) on the tiny GLM-5, and slime's train/rollout
alignment gate on.

The ``cpu`` plugin (its glm5 patches give the spec host linears, torch ops and THD RoPE) with ``dis``,
``staleness`` and ``dsa-determinism``; the torch engine serves the checkpoint (transformers' ``GlmMoeDsa``
aligned to GLM-5's checkpoint semantics: ``slime_ascend.rollout.torch_engine.glm5``); fp32 training; 2 rollouts
with a weight push after each step (``--update-weight-transport disk``), so the second rollout is generated with
the trained weights. The prompts and responses are longer than ``index_topk`` (8): the DSA selection decides the
attention on both sides.
``dsa-determinism`` is what makes the two sides select alike: the indexer's ReLU scores have exact ties (zeros),
which slime's ``torch.topk`` breaks in no fixed order; with the plugin the train side breaks them to the lower
index, as the torch engine always does (without it this job's first step measured a gap of 7.9e-3).

slime's gate, ``--ci-test --ci-train-rollout-logprob-abs-diff-threshold``, asserts in every train step that the
mean absolute gap between the train side's log-probs and the rollout's is within :data:`LOGPROB_GATE`, slime's
own bound for GLM-5 on 8 H100s (``tests/test_glm52_6layer_deterministic_e2e.py``); measured here 1.4e-7 and
1.1e-7 (steps 0 and 1). The unit test (``tests/glm5/test_glm5_train_rollout_logprobs.py``) holds the per-token
gap under it; here the job must pass slime's assertion and the logged gap is checked too. One run of slime's
loop, about a minute.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import TINY_QWEN3_ARGS, make_prompts, run_slime, slime_flags, start_engine, stop

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.timeout(1800)]

PLUGINS = ("cpu", "dis", "staleness", "dsa-determinism")
LOGPROB_GATE = 1e-6
BATCH, N_SAMPLES, NUM_ROLLOUT, MAX_RESPONSE = 4, 2, 2, 16
GLM5_SPEC = ["slime_plugins.models.glm5.glm5", "get_glm5_spec"]


@pytest.fixture(scope="module")
def glm5_dir(tmp_path_factory) -> Path:
    """The tiny GLM-5 (fp32) with the byte tokenizer, as an HF directory."""
    import torch

    from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer, load_model, save_model

    model = load_model(None, dtype=torch.float32, seed=0, glm5=True)
    return save_model(model, tmp_path_factory.mktemp("model") / "tiny-glm5", build_byte_tokenizer())


def _config(work: Path) -> Path:
    out = work / "ascend.yaml"
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *PLUGINS, "-o", str(out)], check=True,
                   capture_output=True, text=True)
    with out.open("a") as f:  # applied after the command line (the plugin flags' --spec) and slime's bf16 rule
        f.write("\nbf16: false  # fp32 training: the gate's bound is an fp32 one\n")
        f.write(f"spec: {GLM5_SPEC}  # slime's own GLM-5 spec, not the cpu plugin's local one\n")
    return out


def _glm5_flags(flags: list[str]) -> list[str]:
    """slime_flags' job with the tiny Qwen3's architecture flags replaced by the tiny GLM-5's."""
    from slime_ascend.glm5.tiny import TINY_GLM5_ARGS

    qwen = TINY_QWEN3_ARGS.split()
    at = next(i for i in range(len(flags)) if flags[i:i + len(qwen)] == qwen)
    arch = list(TINY_GLM5_ARGS)
    spec = arch.index("--spec")
    del arch[spec:spec + 3]  # the spec comes from the YAML (the plugin's --spec is added after these flags)
    return flags[:at] + arch + flags[at + len(qwen):]


def test_train_py_trains_slimes_glm5_spec_within_slimes_logprob_gate(glm5_dir, tmp_path):
    work = tmp_path / "glm5"
    work.mkdir()
    prompts = make_prompts(work / "prompts.jsonl")
    engine = start_engine(glm5_dir, work / "engine.log")
    flags = [f for f in slime_flags(glm5_dir, prompts, [engine], work, num_rollout=NUM_ROLLOUT, batch=BATCH,
                                    n_samples=N_SAMPLES, max_response=MAX_RESPONSE, save=False) if f != "--bf16"]
    flags = _glm5_flags(flags) + [
        "--sglang-enable-deterministic-inference", "--update-weight-disk-keep-files",
        "--ci-test", "--ci-train-rollout-logprob-abs-diff-threshold", str(LOGPROB_GATE)]
    try:
        run = run_slime("train.py", flags, work, PLUGINS, custom_config=_config(work), timeout=1500)
    finally:
        stop(engine.proc)
    print(f"\nglm5: rc {run.returncode}, {run.seconds / 60:.2f} min")
    assert run.returncode == 0, run.log[-8000:]
    assert "bf16 " + "." * 44 + " False" in run.log  # Megatron's argument dump: this run trained in fp32
    assert re.search(r"^\s*spec \.+ \['slime_plugins\.models\.glm5\.glm5', 'get_glm5_spec'\]$", run.log, re.MULTILINE)
    steps = [m for m in run.metrics() if "train/step" in m]
    assert [m["train/step"] for m in steps] == list(range(NUM_ROLLOUT)), steps
    gaps = [m["train/train_rollout_logprob_abs_diff"] for m in steps]
    print(f"train/rollout log-prob gap per step: {gaps}")
    assert all(0 <= g <= LOGPROB_GATE for g in gaps), gaps
    assert any(m["train/grad_norm"] > 0 for m in steps)
    pushes = sorted(p for p in (work / "weights").iterdir() if p.is_dir())
    assert len(pushes) >= NUM_ROLLOUT, pushes  # the initial weights, then a push after the first step
