#!/usr/bin/env bash
# What runs on the accelerator this host has, in a few minutes, and a line saying what ran:
#   bash scripts/device-check.sh            # needs this package installed (and slime's stack for step 3)
#
# device: npu where a real torch_npu is importable and torch.npu has a device; cuda where torch.cuda has one; else
# cpu, where the npu path runs on the emulated Ascend device (slime_ascend.npu_emulation, a test double).
#  1. the device conformance tests (pytest -m device): the npu accelerator's device operations on this device;
#  2. slime-ascend check --device DEVICE: the numeric contracts (log-probs of the same token IDs along two paths,
#     top-k determinism, the DSA top-k on the device against the CPU's); the torch engine on the device (on cpu:
#     the emulated npu) against the same engine on the host;
#  3. slime's own train.py, one rank, when slime is importable (SLIME_SRC or PYTHONPATH): on cpu, the npu plugin on
#     the emulated device (tests/e2e/test_slime_npu_emulated.py, one-rank job); on cuda, the one-rank GRPO job of
#     tests/e2e/test_slime_train_cpu.py (the cpu plugin keeps CUDA on a GPU host: its shims refuse to replace it);
#     on a real npu, not scripted yet (the emulated job's assertions read the emulation's markers): said, not faked.
# Exit status: 0 when every step that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -n "${SLIME_SRC:-}" ]; then export PYTHONPATH="$SLIME_SRC${PYTHONPATH:+:$PYTHONPATH}"; fi
py=${PYTHON:-python}

device=$("$py" - <<'EOF'
import importlib.util
import torch
real_npu = False
if importlib.util.find_spec("torch_npu") is not None:
    import torch_npu
    real_npu = not getattr(torch_npu, "_SLIME_ASCEND_EMULATED", False) and torch.npu.is_available()
print("npu" if real_npu else "cuda" if torch.cuda.is_available() else "cpu")
EOF
) || { echo "device-check: torch does not import" >&2; exit 1; }
slime=$("$py" -c "import importlib.util as u; print('yes' if u.find_spec('slime') and u.find_spec('megatron') else 'no')")
echo "device-check: device $device ($("$py" -c "import platform, torch; print(f'torch {torch.__version__}, {platform.machine()}')")); slime importable: $slime"

failed=0
run() {  # run NAME CMD...: one line per step, its status
  local name=$1; shift
  local t0=$SECONDS
  if "$@" > "/tmp/device-check-$$-$name.log" 2>&1; then
    echo "device-check: $name: passed in $((SECONDS - t0)) s"
  else
    failed=1
    echo "device-check: $name: FAILED in $((SECONDS - t0)) s; last lines:"
    tail -n 20 "/tmp/device-check-$$-$name.log"
  fi
}

run conformance "$py" -m pytest -q -p no:cacheprovider -m device tests/accelerator
run contracts "$py" -m slime_ascend.cli check --device "$device" --json ''
# the torch engine on the device (on cpu: the emulated npu) against the same engine on the host: the same greedy and
# seeded-sampling tokens, log-probs within 1e-4 (another device's kernels), weights on the device
engine_device=$([ "$device" = cpu ] && echo npu || echo "$device")
run engine-on-device env SLIME_ASCEND_EMULATE_NPU=$([ "$device" = cpu ] && echo 1 || echo 0) "$py" -c '
import sys
from slime_ascend.npu_emulation import arm_from_environment
arm_from_environment()
from slime_ascend.rollout.torch_engine.engine import TorchEngine
device = sys.argv[1]
on_device, host = TorchEngine(device=device), TorchEngine(device="cpu")
assert {p.device.type for p in on_device.model.parameters()} == {device}
for params in ({"temperature": 0}, {"temperature": 0.8, "sampling_seed": 7}):
    body = {"input_ids": [1, 17, 250, 3, 999, 42], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, **params}}
    a, b = on_device.generate(dict(body)), host.generate(dict(body))
    assert a["output_ids"] == b["output_ids"], (a["output_ids"], b["output_ids"])
    gap = max(abs(x[0] - y[0]) for x, y in zip(a["meta_info"]["output_token_logprobs"],
                                                b["meta_info"]["output_token_logprobs"]))
    assert gap < 1e-4, gap
    print(f"engine on {on_device.device}: {params}: tokens equal, log-prob gap {gap:.2e}")
' "$engine_device"
if [ "$slime" != yes ]; then
  echo "device-check: slime-loop: not run (slime or megatron not importable: set SLIME_SRC and install its stack)"
elif [ "$device" = cpu ]; then
  run slime-loop-npu-emulated "$py" -m pytest -q -p no:cacheprovider tests/e2e/test_slime_npu_emulated.py -k one_rank
elif [ "$device" = cuda ]; then
  run slime-loop-cuda "$py" -m pytest -q -p no:cacheprovider tests/e2e/test_slime_train_cpu.py -k train_async_py_fully_async
else
  echo "device-check: slime-loop: not scripted on a real NPU yet (the emulated job reads the emulation's markers)"
fi
rm -f /tmp/device-check-$$-*.log
exit $failed
