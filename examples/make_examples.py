"""Regenerate every recipe (ascend.yaml via `slime-ascend config`, run.sh from one template).

Run: python examples/make_examples.py  (after installing a plugin that was missing, e.g. int8-sync).
     python examples/make_examples.py --check  (writes nothing; exit 1 naming each file out of date)
"""
import argparse, os, sys, yaml
from pathlib import Path
from slime_ascend import config
from slime_ascend.rollout.backends import sglang_npu
from slime_ascend.weight_sync.funnel import PLUGIN_FORMATS

ROOT = Path(__file__).resolve().parent
ENV = sglang_npu.BACKEND.env(sglang_npu.BACKEND.defaults())

QWEN = dict(model_sh="qwen3-8B.sh", hf="Qwen3-8B", nodes=1, engine_npus=2, tp=2, ep=1, extra_perf="")
GLM = dict(model_sh="glm4.5-106B-A12B.sh", hf="GLM-4.5-Air", nodes=2, engine_npus=8, tp=4, ep=8, extra_perf="")

RECIPES = [
    ("qwen3-8b-grpo-npu", "Qwen3-8B (dense), GRPO on Ascend: stock slime, SGLang on NPU.", ["sglang-npu"], QWEN, "grpo", None),
    ("glm4.5-air-moe-npu", "GLM-4.5-Air (106B-A12B MoE), GRPO on Ascend: EP training, TP8 SGLang engines on NPU.", ["sglang-npu"], GLM, "grpo", None),
    ("qwen3-8b-sao-npu", "Qwen3-8B, SAO (single-rollout PPO with skip-observation GAE critic) on Ascend.", ["sglang-npu", "sao"], QWEN, "ppo", None),
    ("qwen3-8b-compaction-npu", "Qwen3-8B, CompactionRL (context compaction segments, segment credit) on Ascend.", ["sglang-npu", "compaction"], QWEN, "grpo", None),
    ("glm4.5-air-opd-npu", "GLM-4.5-Air, multi-teacher on-policy distillation (OPD) on Ascend.", ["sglang-npu", "opd"], GLM, "grpo",
     {"ascend_opd_teachers": [
         {"name": "math", "checkpoint_dir": "/root/models/GLM-4.5-Air-math-teacher", "domains": ["math"], "coef": 1.0,
          "url": "http://127.0.0.1:30010"},
         {"name": "code", "checkpoint_dir": "/root/models/GLM-4.5-Air-code-teacher", "domains": ["code"], "coef": 0.5}],
      "ascend_opd_default_teacher": "math",
      "ascend_opd_switch_engine_urls": ["http://127.0.0.1:30011"]}),
    ("qwen3-8b-int8-sync-npu", "Qwen3-8B, GRPO with INT8 (W8A8) rollout weights synced online on Ascend.", ["sglang-npu", "int8-sync"], QWEN, "grpo", None),
    ("qwen3-8b-fp8-sync-npu", "Qwen3-8B, GRPO with FP8 block-wise rollout weights synced online on Ascend.", ["sglang-npu", "fp8-sync"], QWEN, "grpo", None),
    ("qwen3-8b-int4-sync-npu", "Qwen3-8B, GRPO with INT4 group-wise (W4A16) rollout weights synced online on Ascend.", ["sglang-npu", "int4-sync"], QWEN, "grpo", None),
    ("qwen3-8b-mxfp8-sync-npu", "Qwen3-8B, GRPO with MXFP8 (W8A8_MXFP8) rollout weights synced online on Ascend.", ["sglang-npu", "mxfp8-sync"], QWEN, "grpo", None),
]

# the weight-sync plugins: the engines' checkpoint (its directory suffix and what it holds), made by
# `slime-ascend quantize --format F` with F the plugin's own format (weight_sync.funnel.PLUGIN_FORMATS: the
# format its start-up check asks of --hf-checkpoint), and any further converter flags
SYNC = {
    "int8-sync": ("-w8a8", "INT8 (W8A8)", ""),
    "fp8-sync": ("-fp8", "FP8 block-wise (128x128 scales)", ""),
    "int4-sync": ("-int4", "INT4 group-wise (W4A16)", " --group-size ${INT4_GROUP_SIZE:-128}"),
    "mxfp8-sync": ("-mxfp8", "MXFP8 (W8A8_MXFP8)", ""),
}

WHY = {
    "sglang-npu": "SGLang on NPU (device npu, ascend attention backend, HCCL weight sync env; requires npu)",
    "npu": "the Ascend accelerator: HCCL, Ray NPU resources, ASCEND_RT_VISIBLE_DEVICES, MindSpeed bootstrap",
    "sao": "SAO critic: skip-observation GAE advantage, critic iterations",
    "compaction": "CompactionRL: compaction rollout + segment credit",
    "opd": "multi-teacher OPD: teacher routing/switching, teacher log-probs, OPD advantage term",
    "int8-sync": "INT8 online quantisation of the synced weights (quantize_params hook)",
    "fp8-sync": "FP8 block-wise online quantisation of the synced weights (quantize_params hook)",
    "int4-sync": "INT4 group-wise online quantisation of the synced weights (quantize_params hook)",
    "mxfp8-sync": "MXFP8 online quantisation of the synced weights (quantize_params hook)",
}

def edit_yaml(text, edits):
    lines = text.splitlines()
    out = []
    for line in lines:
        key = line.split(":", 1)[0]
        if edits and key in edits and not line.startswith("#"):
            dumped = yaml.safe_dump({key: edits[key]}, default_flow_style=True, sort_keys=False, width=10_000).strip()
            out.append(dumped[1:-1] if dumped.startswith("{") else dumped)
            out.append("# ^ edited for this example (the generated default is in `slime-ascend config`)")
        else:
            out.append(line)
    return "\n".join(out) + "\n"

def render(name, title, plugins, m, est, edits):
    """The recipe's (ascend.yaml, run.sh) texts."""
    try:
        g = config.build(plugins)
        ytext = edit_yaml(g.yaml_text, edits)
        env_value = g.env_value
        cmdline = g.command_line
        names = list(g.plugins)
    except Exception as exc:
        names = ["npu"] + plugins
        env_value = ",".join(names)
        cmdline = []
        ytext = (f"# PLACEHOLDER: regenerate with `slime-ascend config {' '.join(plugins)} -o ascend.yaml --force`\n"
                 f"# (plugin not loadable when this example was written: {str(exc)[:150]})\n"
                 f"ascend_plugins: [{', '.join(names)}]\n")
    train = "train.py"
    plugin_lines = "\n".join(f"#   {p:<11} {WHY.get(p, '')}" for p in names)
    adv = "--advantage-estimator ppo" if est == "ppo" else "--advantage-estimator grpo"
    nspp = "1" if "sao" in plugins else "8"
    gbs = "32" if "sao" in plugins else "256"
    added_cli = []
    for flag, who, why in cmdline:
        if flag.startswith("--advantage-estimator") or flag.startswith("--n-samples-per-prompt"):
            continue  # already in the usual args below (value as the plugin requires)
        if flag.startswith("train_async.py"):
            train = "train_async.py"
            added_cli.append(f"   --rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async  # [ascend:{who}] {why}")
            continue
        if flag.startswith("--megatron-config-path"):
            added_cli.append(f"   --megatron-config-path \"${{HERE}}/sao_megatron.yaml\"  # [ascend:{who}] {why}")
            continue
        added_cli.append(f"   {flag}  # [ascend:{who}] {why}")
    pre = ""
    hf_ckpt = "${BASE}/" + m["hf"]
    if "sao" in plugins:
        pre = ('# [ascend:sao] the critic freeze list slime reads through --megatron-config-path (this script\'s own file),\n'
               '# and the critic\'s own --save: slime saves each role to its args.save, so without it the critic\'s checkpoint\n'
               '# would land on the actor\'s (the sao plugin refuses that at start)\n'
               'python -m slime_ascend.sao.critic -o "${HERE}/sao_megatron.yaml" --force --set '
               f'"save=${{BASE}}/{m["hf"]}_slime_critic/"\n\n')
    for sync in (p for p in plugins if p in SYNC):
        suffix, label, extra = SYNC[sync]
        hf_ckpt = "${BASE}/" + m["hf"] + suffix
        group = ""
        if "--group-size" in extra:
            group = (f'# [ascend:{sync}] INT4_GROUP_SIZE (default 128) must divide the input size of every quantised linear;\n'
                     '# the sync reads it from the checkpoint, so it is set here only\n')
        pre = (f'# [ascend:{sync}] the engines serve the {label} checkpoint and every weight update is quantised\n'
               '# to it; made once from the BF16 model by the offline converter (the same bytes as each online sync)\n'
               + group +
               f'[ -f "{hf_ckpt}/config.json" ] || slime-ascend quantize "${{BASE}}/{m["hf"]}" "{hf_ckpt}" '
               f'--format {PLUGIN_FORMATS[sync][0]}{extra}\n\n')
    if "opd" in plugins:
        pre = ('# [ascend:opd] the teachers\' engines: "math" is served at the URL in ascend.yaml; "code" is loaded on\n'
               '# the switch engine (ascend_opd_switch_engine_urls) with /update_weights_from_disk when its domain comes up.\n'
               '# Start them first (one NPU engine each), e.g.:\n'
               '#   python -m sglang.launch_server --model-path /root/models/GLM-4.5-Air-math-teacher --device npu --port 30010 &\n'
               '#   python -m sglang.launch_server --model-path /root/models/GLM-4.5-Air-math-teacher --device npu --port 30011 &\n\n')
    colocate = "--colocate"
    env_json = ",\n".join(f'    \\"{k}\\": \\"{v}\\"' for k, v in
                          [("PYTHONPATH", "/root/Megatron-LM/"), ("SLIME_ASCEND_PLUGINS", "${SLIME_ASCEND_PLUGINS}")] + list(ENV.items()))
    notes = {
        "sao": "SAO runs PPO with one rollout per prompt; --advantage-estimator ppo and --n-samples-per-prompt 1 are what the plugin requires.",
        "opd": "The teachers section (ascend_opd_teachers) in ascend.yaml is edited for this example: two teachers routed by sample.metadata['domain'].",
        "int8-sync": "The engines load the W8A8 checkpoint that `slime-ascend quantize` makes from the BF16 model (first step below); each weight update is quantised to the same bytes.",
        "fp8-sync": "The engines load the FP8 block-wise checkpoint that `slime-ascend quantize` makes from the BF16 model (first step below); each weight update is quantised to the same bytes.",
        "int4-sync": "The engines load the INT4 group-wise checkpoint that `slime-ascend quantize` makes from the BF16 model (first step below); each weight update is quantised to the same bytes, with the checkpoint's group size and compressed-tensors' rounding (ascend_int4_sync_numerics).",
        "mxfp8-sync": "The engines load the MXFP8 checkpoint (msModelSlim's W8A8_MXFP8 layout) that `slime-ascend quantize` makes from the BF16 model (first step below); each weight update is quantised to the same bytes. Not checked yet: whether SGLang's Ascend MXFP8 layer, which re-lays its weights out after loading, takes a weight update in place.",
        "compaction": "Compaction replaces the rollout's generate function and credits segments; the YAML carries every hook path.",
    }
    note = "".join(f"# Note: {notes[p]}\n" for p in plugins if p in notes)
    actor_npus = "${NUM_NPUS}"
    if train == "train_async.py":  # slime's async loop does not colocate: split the NPUs
        colocate = "--rollout-num-gpus $((NUM_NPUS / 2))"
        actor_npus = "$((NUM_NPUS / 2))"
    else:  # colocated on NPU: the train actors end around each rollout (no torch_memory_saver offload on NPU)
        shared = " (a directory every node sees)" if m["nodes"] > 1 else ""
        added_cli += [
            "   --release-train  # [ascend:npu] --colocate on NPU: torch_memory_saver's NPU build cannot offload the "
            "train actors (no preload hook), so slime ends them around each rollout and reloads them from --save "
            "(every step)",
            f"   --update-weight-transport disk --update-weight-disk-dir ${{BASE}}/slime_weight_sync  # [ascend:npu] "
            f"what --release-train syncs the engines through{shared}"]
    cli_block = ("\n".join(added_cli) + "\n") if added_cli else ""
    multinode = ("# Multi-node: on every other node run the same exports, then\n#   ray start --address=${MASTER_ADDR}:6379 --disable-usage-stats\n"
                 if m["nodes"] > 1 else "")
    ascend_block = ("# [ascend] flags slime reads before the YAML is applied (the plugins check them at start)\nASCEND_ARGS=(\n" + cli_block + ")\n\n") if added_cli else ""
    ascend_use = '   "${ASCEND_ARGS[@]}" \\\n' if added_cli else ""
    script = f"""#!/bin/bash
# {title}
#
# This is a stock slime launch (same flags as slime's scripts/run-*.sh); lines tagged [ascend]
# are the only additions. The one added slime flag is --custom-config-path ascend.yaml, written by:
#   slime-ascend config {' '.join(plugins)} -o ascend.yaml
# Plugins it enables (SLIME_ASCEND_PLUGINS must equal ascend_plugins in ascend.yaml):
{plugin_lines}
{note}#
# Needs: slime (THUDM/slime) with Megatron-LM/MindSpeed, SGLang with sgl-kernel-npu, torch_npu, CANN,
# and slime-ascend installed in the same environment on every node (pip install slime-ascend[npu]).
set -euo pipefail

SLIME_DIR=${{SLIME_DIR:-/root/slime}}
BASE=${{BASE:-/root}}
HERE="$(cd -- "$(dirname -- "${{BASH_SOURCE[0]}}")" &>/dev/null && pwd)"
NUM_NPUS=${{NUM_NPUS:-8}}
export PYTHONUNBUFFERED=1

# [ascend] the bootstrap (.pth) activates these plugins in every process: driver, Ray actors, SGLang servers
export SLIME_ASCEND_PLUGINS={env_value}
# [ascend:npu] CANN's environment first, in this shell, so that `ray start` below can import pyACL and count
# the NPUs (without it Ray counts /dev/davinci? device files: at most 10)
ASCEND_SET_ENV=${{ASCEND_SET_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}}
if [ -z "${{ASCEND_HOME_PATH:-}}" ] && [ -f "${{ASCEND_SET_ENV}}" ]; then set +u; source "${{ASCEND_SET_ENV}}"; set -u; fi
# [ascend:npu] torch_npu refuses to start its allocator with PYTORCH_ALLOC_CONF set beside PYTORCH_NPU_ALLOC_CONF
unset PYTORCH_ALLOC_CONF
# [ascend:sglang-npu] engine environment: FIA decode path, HCCL weight-update ports, no expandable
# segments (breaks sleep mode). The sglang-npu launch bridge sets the same defaults where unset, and the
# train actors get the same HCCL ports (every card of the weight-update group must).
{chr(10).join(f'export {k}={v}' for k, v in ENV.items())}

{pre}source "${{SLIME_DIR}}/scripts/models/{m['model_sh']}"

CKPT_ARGS=(
   --hf-checkpoint {hf_ckpt}
   --ref-load ${{BASE}}/{m['hf']}_torch_dist
   --load ${{BASE}}/{m['hf']}_slime/
   --save ${{BASE}}/{m['hf']}_slime/
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data ${{BASE}}/dapo-math-17k/dapo-math-17k.jsonl
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt {nspp}
   --rollout-max-response-len 8192
   --rollout-temperature 1
   --global-batch-size {gbs}
   --balance-data
)

PERF_ARGS=(
   --tensor-model-parallel-size {m['tp']}
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size {m['ep']}
   --expert-tensor-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
)

ALGO_ARGS=(
   {adv}
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine {m['engine_npus']}
   --sglang-mem-fraction-static 0.7
)

{ascend_block}MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
)

# Ray exposes Ascend NPUs as the NPU resource; slime-ascend's npu plugin makes slime ask for it.
# The dashboard (and job API) listens on loopback only; from elsewhere use ssh -L 8265:127.0.0.1:8265.
# A Ray cluster already running here may hold other people's jobs: it is stopped only with RESTART_RAY=1.
if ray status >/dev/null 2>&1; then
  if [ "${{RESTART_RAY:-0}}" = 1 ]; then ray stop; else
    echo "error: a Ray cluster is already running on this node. Fix: stop it (ray stop) if it is yours, or rerun with RESTART_RAY=1" >&2
    exit 1
  fi
fi
{multinode}ray start --head --node-ip-address ${{MASTER_ADDR:-127.0.0.1}} --disable-usage-stats --dashboard-host=127.0.0.1 --dashboard-port=8265

RUNTIME_ENV_JSON="{{
  \\"env_vars\\": {{
{env_json}
  }}
}}"

ray job submit --address="http://127.0.0.1:8265" \\
   --runtime-env-json="${{RUNTIME_ENV_JSON}}" \\
   -- python3 "${{SLIME_DIR}}/{train}" \\
   --actor-num-nodes {m['nodes']} \\
   --actor-num-gpus-per-node {actor_npus} \\
   {colocate} \\
   "${{MODEL_ARGS[@]}}" \\
   "${{CKPT_ARGS[@]}}" \\
   "${{ROLLOUT_ARGS[@]}}" \\
   "${{PERF_ARGS[@]}}" \\
   "${{ALGO_ARGS[@]}}" \\
   "${{OPTIMIZER_ARGS[@]}}" \\
   "${{SGLANG_ARGS[@]}}" \\
   "${{MISC_ARGS[@]}}" \\
{ascend_use}   --custom-config-path "${{HERE}}/ascend.yaml"  # [ascend] the added slime flag: our hooks, settings, sglang-npu
"""
    return ytext, script


def main(argv=None):
    parser = argparse.ArgumentParser(description="regenerate (or, with --check, compare) every recipe")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each file out of date")
    check = parser.parse_args(argv).check
    stale = []
    for recipe in RECIPES:
        d = ROOT / recipe[0]
        for path, text in zip((d / "ascend.yaml", d / "run.sh"), render(*recipe)):
            if check:
                if not path.is_file() or path.read_text() != text:
                    stale.append(str(path.relative_to(ROOT.parent)))
                continue
            d.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        if not check:
            os.chmod(d / "run.sh", 0o755)
            print(recipe[0])
    if stale:
        print("out of date (regenerate with python examples/make_examples.py):", *stale, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
