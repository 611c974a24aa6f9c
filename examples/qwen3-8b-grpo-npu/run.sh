#!/bin/bash
# Qwen3-8B (dense), GRPO on Ascend: stock slime, SGLang on NPU.
#
# This is a stock slime launch (same flags as slime's scripts/run-*.sh); lines tagged [ascend]
# are the only additions. The one added slime flag is --custom-config-path ascend.yaml, written by:
#   slime-ascend config sglang-npu -o ascend.yaml
# Plugins it enables (SLIME_ASCEND_PLUGINS must equal ascend_plugins in ascend.yaml):
#   npu         the Ascend accelerator: HCCL, Ray NPU resources, ASCEND_RT_VISIBLE_DEVICES, MindSpeed bootstrap
#   sglang-npu  SGLang on NPU (device npu, ascend attention backend, HCCL weight sync env; requires npu)
#
# Needs: slime (THUDM/slime) with Megatron-LM/MindSpeed, SGLang with sgl-kernel-npu, torch_npu, CANN,
# and slime-ascend installed in the same environment on every node (pip install slime-ascend[npu]).
set -euo pipefail

SLIME_DIR=${SLIME_DIR:-/root/slime}
BASE=${BASE:-/root}
HERE="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
NUM_NPUS=${NUM_NPUS:-8}
export PYTHONUNBUFFERED=1

# [ascend] the bootstrap (.pth) activates these plugins in every process: driver, Ray actors, SGLang servers
export SLIME_ASCEND_PLUGINS=npu,sglang-npu
# [ascend:npu] CANN's environment first, in this shell, so that `ray start` below can import pyACL and count
# the NPUs (without it Ray counts /dev/davinci? device files: at most 10)
ASCEND_SET_ENV=${ASCEND_SET_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}
if [ -z "${ASCEND_HOME_PATH:-}" ] && [ -f "${ASCEND_SET_ENV}" ]; then set +u; source "${ASCEND_SET_ENV}"; set -u; fi
# [ascend:npu] torch_npu refuses to start its allocator with PYTORCH_ALLOC_CONF set beside PYTORCH_NPU_ALLOC_CONF
unset PYTORCH_ALLOC_CONF
# [ascend:sglang-npu] engine environment: FIA decode path, HCCL weight-update ports, no expandable
# segments (breaks sleep mode). The sglang-npu launch bridge sets the same defaults where unset, and the
# train actors get the same HCCL ports (every card of the weight-update group must).
export ASCEND_USE_FIA=1
export HCCL_HOST_SOCKET_PORT_RANGE=60000-60050
export HCCL_NPU_SOCKET_PORT_RANGE=61000-61050
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:False

source "${SLIME_DIR}/scripts/models/qwen3-8B.sh"

CKPT_ARGS=(
   --hf-checkpoint ${BASE}/Qwen3-8B
   --ref-load ${BASE}/Qwen3-8B_torch_dist
   --load ${BASE}/Qwen3-8B_slime/
   --save ${BASE}/Qwen3-8B_slime/
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data ${BASE}/dapo-math-17k/dapo-math-17k.jsonl
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 1
   --global-batch-size 256
   --balance-data
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 1
   --expert-tensor-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
)

ALGO_ARGS=(
   --advantage-estimator grpo
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
   --rollout-num-gpus-per-engine 2
   --sglang-mem-fraction-static 0.7
)

# [ascend] flags slime reads before the YAML is applied (the plugins check them at start)
ASCEND_ARGS=(
   --release-train  # [ascend:npu] --colocate on NPU: torch_memory_saver's NPU build cannot offload the train actors (no preload hook), so slime ends them around each rollout and reloads them from --save (every step)
   --update-weight-transport disk --update-weight-disk-dir ${BASE}/slime_weight_sync  # [ascend:npu] what --release-train syncs the engines through
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
)

# Ray exposes Ascend NPUs as the NPU resource; slime-ascend's npu plugin makes slime ask for it.
# The dashboard (and job API) listens on loopback only; from elsewhere use ssh -L 8265:127.0.0.1:8265.
# A Ray cluster already running here may hold other people's jobs: it is stopped only with RESTART_RAY=1.
if ray status >/dev/null 2>&1; then
  if [ "${RESTART_RAY:-0}" = 1 ]; then ray stop; else
    echo "error: a Ray cluster is already running on this node. Fix: stop it (ray stop) if it is yours, or rerun with RESTART_RAY=1" >&2
    exit 1
  fi
fi
ray start --head --node-ip-address ${MASTER_ADDR:-127.0.0.1} --disable-usage-stats --dashboard-host=127.0.0.1 --dashboard-port=8265

RUNTIME_ENV_JSON="{
  \"env_vars\": {
    \"PYTHONPATH\": \"/root/Megatron-LM/\",
    \"SLIME_ASCEND_PLUGINS\": \"${SLIME_ASCEND_PLUGINS}\",
    \"ASCEND_USE_FIA\": \"1\",
    \"HCCL_HOST_SOCKET_PORT_RANGE\": \"60000-60050\",
    \"HCCL_NPU_SOCKET_PORT_RANGE\": \"61000-61050\",
    \"PYTORCH_NPU_ALLOC_CONF\": \"expandable_segments:False\"
  }
}"

ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json="${RUNTIME_ENV_JSON}" \
   -- python3 "${SLIME_DIR}/train.py" \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node ${NUM_NPUS} \
   --colocate \
   "${MODEL_ARGS[@]}" \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${ALGO_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${SGLANG_ARGS[@]}" \
   "${MISC_ARGS[@]}" \
   "${ASCEND_ARGS[@]}" \
   --custom-config-path "${HERE}/ascend.yaml"  # [ascend] the added slime flag: our hooks, settings, sglang-npu
