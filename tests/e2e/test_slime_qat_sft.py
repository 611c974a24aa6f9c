"""``qat`` in slime's SFT loop (issue 44, items 1 and 2): stock ``train.py`` with slime's own SFT flags (those of
its ``scripts/run-qwen3-4B-base-sft.sh``: ``slime.rollout.sft_rollout.generate_rollout``, ``--loss-type
sft_loss``, ``--calculate-per-token-loss``, ``--disable-compute-advantages-and-returns``, ``--debug-train-only``) on
the tiny Qwen3 with the ``cpu`` and ``qat`` plugins (int4-group, group size 32; no sync plugin: the spec is the one
``slime-ascend quantize --format int4-group --group-size 32`` writes), fp32 training, 3 steps of 4 conversations,
a checkpoint after every step (``--save-interval 1``).

What an SFT user of QAT is promised: the model they export is the model they trained. Checked from slime's own
output: the loss slime logged for step k (``train/loss``, Megatron's forward with the fake-quantised weights of
the checkpoint saved after step k - 1; for step 0, of the checkpoint slime loaded) against the loss of the int4 export of that checkpoint (slime's own
``tools/convert_torch_dist_to_hf.py``, then ``slime-ascend quantize``), computed by transformers' Qwen3 on the
tokens and loss masks slime trained step k on (its ``--save-debug-train-data`` dump). They agree within
``EXPORT_RTOL`` (the two sides' fp32 rounding, Megatron's and transformers' kernels; measured 1.2e-9 to 5e-8
relative); the same checkpoint unquantised (the float model a trainer without QAT would export at full
precision) is more than ``CONTROL_RTOL`` away (measured 1.6e-4 to 8.7e-4): the figure slime trained on is the int4
model's. One slime job without engines (``--debug-train-only``), 30 s alone on the 2-core host.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import TINY_QWEN3_ARGS, make_model, run_slime
from test_slime_weight_sync import torch_dist_to_hf

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1200)]

NUM_ROLLOUT, BATCH, GROUP = 3, 4, 32
EXPORT_RTOL = 1e-6  # int4 export's loss vs slime's fake-quant loss of the same weights, relative (measured <= 5e-8)
CONTROL_RTOL = 5e-5  # the unquantised weights' loss: at least this far from slime's figure (measured >= 1.6e-4)
PLUGINS = ("cpu", "qat")
# the tiny byte tokenizer's chat template (slime's SFT rollout builds tokens and loss masks with it)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _conversations(path: Path, n: int = NUM_ROLLOUT * BATCH) -> Path:
    with path.open("w") as f:
        for i in range(n):
            messages = [{"role": "user", "content": f"Q{i}: what is {i} plus 2?"},
                        {"role": "assistant", "content": f"{i} plus 2 is {i + 2}."}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def _config(work: Path) -> Path:
    import yaml

    from slime_ascend.cli import main

    out = work / "ascend.yaml"
    assert main(["config", *PLUGINS, "-o", str(out)]) == 0
    cfg = yaml.safe_load(out.read_text())
    cfg.update(bf16=False, ascend_qat_format="int4-group", ascend_qat_group_size=GROUP)  # fp32 master weights
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def sft_job(tmp_path_factory):
    work = tmp_path_factory.mktemp("qat-sft")
    model = make_model(work / "tiny-qwen3")
    tokenizer_config = model / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()),
                                            "chat_template": CHAT_TEMPLATE}))
    data = _conversations(work / "sft.jsonl")
    flags = f"""
      --hf-checkpoint {model} --load {model} --save {work / 'ckpt'} --save-interval 1
      {TINY_QWEN3_ARGS}
      --rollout-function-path slime.rollout.sft_rollout.generate_rollout
      --prompt-data {data} --input-key messages
      --loss-type sft_loss --calculate-per-token-loss --disable-compute-advantages-and-returns --debug-train-only
      --num-rollout {NUM_ROLLOUT} --rollout-batch-size {BATCH} --global-batch-size {BATCH} --micro-batch-size 1
      --seq-length 256 --max-position-embeddings 4096
      --optimizer adam --lr 1e-3 --lr-decay-style constant --weight-decay 0.0 --adam-beta1 0.9 --adam-beta2 0.98
      --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1
      --actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus-per-engine 1
      --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
      --attention-softmax-in-fp32 --seed 1234
      --save-debug-train-data {work / 'dump' / 'train_{rollout_id}.pt'}
    """.split()
    run = run_slime("train.py", flags, work, PLUGINS, custom_config=_config(work))
    print(f"\nqat sft: rc {run.returncode}, {run.seconds / 60:.2f} min")
    assert run.returncode == 0, run.log[-6000:]
    return work, model, run


def _sft_loss(model_dir: Path, samples: list[dict]) -> float:
    """slime's ``sft_loss`` with ``--calculate-per-token-loss`` for one step of one rank: the negative log-likelihood
    of every loss-masked response token, summed over the step's samples, over their number of such tokens."""
    import torch

    from slime_ascend.rollout.torch_engine.model import load_model

    model = load_model(model_dir, torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            tokens = torch.as_tensor(list(map(int, sample["tokens"])))
            n = int(sample["response_lengths"])
            mask = torch.as_tensor(sample["loss_masks"]).float()
            assert mask.numel() == n > 0
            logits = model(input_ids=tokens[:-1].reshape(1, -1), use_cache=False).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[1:].reshape(-1, 1)).squeeze(-1)[-n:]
            total -= float((logp * mask).sum())
            count += int(mask.sum())
    return total / count


def test_the_int4_export_of_a_qat_sft_checkpoint_has_the_loss_slime_trained_on(sft_job):
    import torch

    from parallel_evidence import fp32_copy, quantize

    work, model, run = sft_job
    assert "qat: fake-quantising" in run.log and "int4-group" in run.log
    assert "slime.rollout.sft_rollout" in run.log or "sft_rollout" in run.log
    losses = [m["train/loss"] for m in run.metrics() if "train/loss" in m]
    assert len(losses) == NUM_ROLLOUT, run.metrics()
    rows = []
    for step in range(NUM_ROLLOUT):
        if step == 0:  # the weights slime loaded (--load), as the fp32 master copy it trains (the exporter's scales
            # are computed in its input's dtype: quantising the BF16 originals rounds some differently)
            hf = fp32_copy(model, work / "hf-0")
        else:  # iter_{step - 1}: saved after step - 1, the weights step `step` trained from
            hf = torch_dist_to_hf(work / "ckpt", model, work / f"hf-{step}", PLUGINS, iteration=step - 1)
        export = quantize(hf, work / f"int4-{step}", "int4-group", "--group-size", str(GROUP))
        samples = torch.load(work / "dump" / f"train_{step}.pt", weights_only=False)["samples"]
        assert len(samples) == BATCH
        exported, plain = _sft_loss(export, samples), _sft_loss(hf, samples)
        rows.append((step, losses[step], exported, plain))
        print(f"step {step}: slime's fake-quant loss {losses[step]:.7f}, int4 export {exported:.7f} "
              f"(rel {abs(exported - losses[step]) / losses[step]:.1e}), unquantised {plain:.7f} "
              f"(rel {abs(plain - losses[step]) / losses[step]:.1e})")
    for step, slime_loss, exported, plain in rows:
        assert abs(exported - slime_loss) <= EXPORT_RTOL * slime_loss, rows
        assert abs(plain - slime_loss) >= CONTROL_RTOL * slime_loss, rows
    assert losses[-1] < losses[0], losses  # SFT under QAT learns
