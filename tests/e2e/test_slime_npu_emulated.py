"""slime's own ``train.py`` with the ``npu`` plugin and NO ``cpu`` plugin, on the emulated Ascend device.

``SLIME_ASCEND_EMULATE_NPU=1`` makes every process of the job an Ascend host with torch_npu
(:mod:`slime_ascend.npu_emulation`: the ``npu`` device on host memory, ``torch.npu``, the ``hccl`` backend over gloo,
a ``torch_npu`` whose version ends in ``+emulated``). The ``npu`` plugin then runs slime's train actors the way an
Ascend host without MindSpeed needs: ``torch_npu.contrib.transfer_to_npu`` imported before Megatron, MindSpeed's two
Megatron adaptations as runtime patches (``train.npu_tensor_type``, ``train.npu_cuda_rng_state``,
``train.npu_device_arch_version``). Nothing of the
``cpu`` plugin runs: no ``train.cpu_*`` shim, Megatron's own CUDA RNG tracker (no ``--inference-rng-tracker``), GPU
initialisation (no ``--use-cpu-initialization``). The Megatron flags below are what any user without
TransformerEngine passes (the local transformer, no TE/apex fusions); the spec :mod:`slime_ascend.cpu.spec` is
device-neutral (torch operators only, placed by Megatron on the current device).

Each job runs stock slime (RayTrainGroup, RolloutManager, slime's router, Megatron train actors) against the torch
engine serving an ``int8-w8a8`` checkpoint on the emulated device too (``serve-torch --device npu``), with ``dis``, ``staleness``, ``tito`` and ``int8-sync``, and reads its evidence from slime's own output: the accelerator slime's registry picked in the train actor
(``npu``, process groups ``hccl``), Ray placing the actors on ``NPU``, the step metrics, the weight versions the
engine loaded (in int8), and a device probe slime itself calls at every train step
(``--custom-megatron-before-train-step-hook-path``, ``npu_device_probe.py``): every parameter, ``main_grad`` and
optimizer tensor on ``npu``, and the operators the emulated device ran in the step.

A stray host tensor in the step fails the job: the emulated device raises, as a real NPU does, on any operator that
mixes an ``npu`` tensor with a ``cpu`` tensor that is not a 0-dim scalar, and the probe stops the job on a parameter,
gradient or optimizer tensor off ``npu``.

CI runs the job at tensor parallelism 2 (two train actors, one HCCL group over gloo); the same job at one rank passed
the same checks and runs with ``SLIME_ASCEND_ALL_CASES=1`` (marked ``all_cases``: every check of it is made at TP 2
too, with the same plugins; CI time: 1.5 min a run on 2 busy cores).

What this does not cover (the emulation's limits): NPU kernels' numerics and formats (every operator runs on the
host's CPU kernels), HCCL's timing and topology (gloo underneath), CANN, and MindSpeed itself (not installable here:
its adaptor's other patches are not exercised; the two adaptations Megatron cannot do without are).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import make_prompts, run_slime, slime_flags, start_engine, stop
from e2e_fixtures import model_dir  # noqa: F401  (pytest fixture)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1200)]

HERE = Path(__file__).parent
FMT = "int8-w8a8"
BATCH, N_SAMPLES, NUM_ROLLOUT = 4, 4, 2
# what a user without TransformerEngine (and without MindSpeed, which would stand in for it) passes to Megatron
NO_TE_FLAGS = ["--transformer-impl", "local", "--spec", "slime_ascend.cpu.spec", "get_layer_spec",
               "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
               "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm"]
PROBE = ["--custom-megatron-before-train-step-hook-path", "npu_device_probe.before_train_step"]
# MindSpeed's Megatron adaptations transfer_to_npu lacks, the npu plugin's patches where MindSpeed is absent
NPU_PATCHES = ("train.npu_cuda_rng_state", "train.npu_device_arch_version", "train.npu_tensor_type")


def _cli(*argv: str) -> None:
    out = subprocess.run([sys.executable, "-m", "slime_ascend.cli", *argv], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _run(model_dir: Path, tmp_path: Path, plugins: tuple[str, ...], tp: int):
    qdir = tmp_path / f"tiny-qwen3-{FMT}"
    _cli("quantize", str(model_dir), str(qdir), "--format", FMT)
    # the engine computes on the emulated Ascend device too (serve-torch --device npu)
    engine = start_engine(qdir, tmp_path / "engine.log", ready=False, engine_args=("--device", "npu"),
                          extra_env={"SLIME_ASCEND_EMULATE_NPU": "1"})
    try:
        config = tmp_path / "ascend.yaml"
        _cli("config", *plugins, "-o", str(config))
        prompts = make_prompts(tmp_path / "prompts.jsonl")
        flags = slime_flags(model_dir, prompts, [engine], tmp_path, num_rollout=NUM_ROLLOUT, n_samples=N_SAMPLES,
                            batch=BATCH, save=False)
        flags[flags.index("--hf-checkpoint") + 1] = str(qdir)  # the engine's format is what int8-sync pushes
        flags[flags.index("--tensor-model-parallel-size") + 1] = str(tp)
        flags[flags.index("--actor-num-gpus-per-node") + 1] = str(tp)
        run = run_slime("train.py", flags + NO_TE_FLAGS + PROBE + ["--update-weight-disk-keep-files"], tmp_path,
                        plugins, custom_config=config,
                        # Megatron asks for CUDA_DEVICE_MAX_CONNECTIONS=1 at TP > 1 below arch 10 (MindSpeed's 8): what
                        # Ascend launch scripts export
                        extra_env={"SLIME_ASCEND_EMULATE_NPU": "1", "PYTHONPATH": str(HERE),
                                   "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    finally:
        stop(engine.proc)
    print(f"slime train.py on the emulated npu, TP {tp}: {run.seconds:.0f} s")
    assert run.returncode == 0, run.log[-8000:]
    return run, qdir, engine.log.read_text()


def _steps(run, key: str) -> list[dict]:
    return [m for m in run.metrics() if key in m]


def _rollout_reports(run, name: str) -> list[dict]:
    return [m for m in run.metrics() if any(k.startswith(f"rollout/{name}_") for k in m)]


def _check_npu_job(run, plugins: tuple[str, ...], tp: int, qdir: Path, tmp_path: Path, engine_log: str) -> None:
    lines = run.log.splitlines()
    active = f"slime-ascend plugins active: {', '.join(plugins)}"
    for role in ("RolloutManager", "MegatronTrainRayActor"):
        assert any(role in line and active in line for line in lines), role
    # slime's registry picked npu over the emulated torch_npu (not npu-as-cpu) in every train actor, with hccl
    # process groups; Ray gave each bundle an NPU and the actor's LOCAL_RANK is that id
    device = [line for line in lines if "slime accelerator in the actor train actor" in line]
    assert len(device) == tp and all("MegatronTrainRayActor" in line for line in device), device
    ranks = sorted(re.search(r": npu \(process groups hccl, ASCEND_RT_VISIBLE_DEVICES=\S*, LOCAL_RANK=(\d+)\)$",
                             line).group(1) for line in device)
    bundles = sorted(re.findall(r"bundle +\d+, actual_bundle_index: +\d+, node: \S+, gpu: (\d+)$", run.log,
                                re.MULTILINE))
    assert ranks == bundles and len(bundles) == tp, (ranks, bundles)
    # the Ascend path without MindSpeed: transfer_to_npu before Megatron, MindSpeed's two adaptations, and none of
    # the cpu plugin's shims
    for patch_id in ("driver.ray_npu_resources", *NPU_PATCHES, "train.disable_torch_compile",
                     "train.quantize_params", "train.weight_sync_metrics"):
        assert f"applied runtime patch {patch_id}" in run.log, patch_id
    assert "applied runtime patch train.cpu_" not in run.log and "applied runtime patch driver.ray_cpu" not in run.log
    assert "npu: MindSpeed is not installed: torch_npu.contrib.transfer_to_npu imported before Megatron" in run.log
    assert len(re.findall(r"MegatronTrainRayActor.*backend=hccl, rank=\d+, world_size=%d" % tp, run.log)) == tp
    # the probe slime called at each train step: at every rank, everything on npu; at rollout 1 (after the step of
    # rollout 0) the optimizer holds its state, and the device ran the step's operators
    probes = re.findall(r"npu device probe: rank (\d+) rollout (\d+) step 0: params (\d+) main_grads (\d+) "
                        r"optimizer_tensors (\d+) off_npu (\d+) ops_since_last (\S+) torch_npu (\S+) "
                        r"current_device (\d+) transfer_to_npu (\w+) patches (\S+)", run.log)
    assert sorted((int(p[0]), int(p[1])) for p in probes) == [(r, i) for r in range(tp) for i in range(NUM_ROLLOUT)]
    for rank, rollout, params, grads, state, off, ops, version, current, transfer, applied in probes:
        assert version.endswith("+emulated") and int(off) == 0 and int(params) > 0 and grads == params, probes
        assert transfer == "True" and applied == ",".join(NPU_PATCHES), probes
        assert current in ranks, (probes, ranks)  # the train actor's device is the NPU Ray gave it
        if rollout == "1":
            assert int(state) >= 3 * int(params) and int(ops) > 1000, probes  # main params + exp_avg + exp_avg_sq
    train_steps = _steps(run, "train/step")
    assert [m["train/step"] for m in train_steps] == list(range(NUM_ROLLOUT))
    for m in train_steps:
        assert 0.0 <= m["train/dis_masked"] <= 1.0 and "train/dis_ratio" in m, m
    assert any(m["train/grad_norm"] > 0 for m in train_steps), train_steps
    assert all(m["train/train_rollout_logprob_abs_diff"] < 0.05 for m in train_steps)
    staleness = _rollout_reports(run, "staleness")
    assert len(staleness) == NUM_ROLLOUT, staleness
    for m in staleness:
        assert m["rollout/staleness_rollouts"] == m["rollout/staleness_kept"] == BATCH * N_SAMPLES, m
        assert m["rollout/staleness_dropped"] == m["rollout/staleness_max_lag"] == 0, m
    assert [m["rollout/staleness_trainer_version"] for m in staleness] == [1, 2]
    assert [m["rollout/staleness_acknowledged_version"] for m in staleness] == [1, 2], staleness
    # int8-sync: each version slime pushed (one before training, one after each step) quantised; the engine
    # loaded every one in int8-w8a8
    assert f"int8-sync: rollout checkpoint {qdir} is {FMT}" in run.log
    syncs = _steps(run, "perf/weight_sync_bytes")
    assert len(syncs) == NUM_ROLLOUT, syncs
    for m in syncs:
        assert m["perf/weight_sync_quantized_params"] > 0 and 0 < m["perf/weight_sync_bytes"] < \
            m["perf/weight_sync_source_bytes"], m
    # the engine served on the emulated NPU: every version slime pushed was copied onto it
    assert re.search(r"^torch engine serving \S+ on npu:0 at http://", engine_log, re.M), engine_log[-3000:]
    weights = tmp_path / "weights"
    versions = sorted(p.name for p in weights.iterdir())
    assert versions == [f"weight_v{v:06d}" for v in range(1, NUM_ROLLOUT + 2)], versions
    for v, name in enumerate(versions, start=1):
        assert f"loaded weight version {v} from {weights / name} ({FMT})" in engine_log, engine_log[-3000:]
        assert f"weight version {v} acknowledged by every engine (1)" in run.log, v


def _check_tito_and_trackers(run) -> None:
    # tito checked every sample's tokens against its rollout record before slime built the train data
    tito = _rollout_reports(run, "tito")
    assert [m["rollout/tito_checked_samples"] for m in tito] == [BATCH * N_SAMPLES] * NUM_ROLLOUT, tito
    assert all(m["rollout/tito_unrecorded_samples"] == 0 for m in tito)
    # the plugins' numbers reached slime's trackers (TensorBoard here; wandb gets the same calls)
    tracked = run.tracked()
    assert [step for step, _ in tracked["train/dis_masked"]] == list(range(NUM_ROLLOUT))
    assert [v for _, v in tracked["rollout/staleness_kept"]] == [BATCH * N_SAMPLES] * NUM_ROLLOUT
    assert [v for _, v in tracked["rollout/tito_checked_samples"]] == [BATCH * N_SAMPLES] * NUM_ROLLOUT


@pytest.mark.all_cases
def test_train_py_on_the_emulated_npu_one_rank_dis_staleness_tito_int8_sync(model_dir, tmp_path):
    plugins = ("npu", "dis", "staleness", "tito", "int8-sync")
    run, qdir, engine_log = _run(model_dir, tmp_path, plugins, tp=1)
    _check_npu_job(run, plugins, 1, qdir, tmp_path, engine_log)
    _check_tito_and_trackers(run)


def test_train_py_on_the_emulated_npu_tensor_parallel_2_dis_staleness_tito_int8_sync(model_dir, tmp_path):
    plugins = ("npu", "dis", "staleness", "tito", "int8-sync")
    run, qdir, engine_log = _run(model_dir, tmp_path, plugins, tp=2)
    _check_npu_job(run, plugins, 2, qdir, tmp_path, engine_log)
    _check_tito_and_trackers(run)
