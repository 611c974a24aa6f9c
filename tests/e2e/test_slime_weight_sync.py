"""``int8-sync`` and ``fp8-sync`` in slime's own ``train.py`` on this CPU, over slime's two weight transports.

Both jobs train the tiny BF16 model (``--load``) while the rollout engine (the torch engine) serves a checkpoint
made by ``slime-ascend quantize`` from it (``--hf-checkpoint``); the sync plugin makes slime push every weight
version in the engine's format.

* ``int8-sync``, ``--update-weight-transport disk``: one external engine (``--rollout-external-engine-addrs``);
  slime writes each version as an HF directory and the engine reloads it. Evidence: slime's
  ``perf/weight_sync_*`` metrics, the engine's ``/model_info`` and log (it loaded every version slime wrote,
  serves the last one, in the quantised format), and the bytes of the directories slime wrote.
* ``fp8-sync``, slime's default transport (``nccl``, which slime's accelerator maps to gloo under the ``cpu``
  plugin: ``update_weights_from_distributed``): two engines started by slime itself (the ``torch-engine`` plugin:
  slime's ``SGLangEngine`` actors launch them, register them with slime's router and join them to the broadcast
  group), float8 on gloo as its bytes (``train.gloo_float8_broadcast``), every version after the first as a delta
  (``ascend_fp8_sync_distributed_delta``: only the fp8 blocks and scales that changed). Evidence: the same metrics; each
  engine's log (it switched to every version, from the broadcast, in fp8-block); the driver's read-back of every
  engine's version after each push (``driver.acknowledged_collective_update``); nothing written to disk; and the
  bytes each engine **holds** after each push, read from it with SGLang's ``/get_weights_by_name`` (``return_raw``:
  the exact bytes) inside slime's loop, by slime's eval hook, which runs right after each push
  (``tests/e2e/weight_probe.py``, ``--eval-interval 1``).

The bytes, in both jobs: the first version slime pushed (the BF16 weights slime loaded, before any training) is
tensor-for-tensor identical to ``slime-ascend quantize`` of those BF16 weights, and the last version (after
training) to ``slime-ascend quantize`` of slime's own Megatron checkpoint of the same step, converted to HF BF16 by
slime's own ``tools/convert_torch_dist_to_hf.py``; training changed them (the comparison is not vacuous).

One slime run per format (the sync plugins conflict: one job syncs one format). CI runs the fp8-sync job; the
int8-sync job passed the same checks and runs with ``SLIME_ASCEND_ALL_CASES=1`` (marked ``all_cases``; CI time: 2.5
min on 2 busy cores): in CI, ``int8-sync`` over the disk transport runs in every layout of
``test_slime_parallel_cpu.py``, whose first push is byte-identical to ``slime-ascend quantize --format int8-w8a8``
of the loaded weights, and on the emulated NPU (``test_slime_npu_emulated.py``: the engine loads every version in
int8); the trained version's bytes against slime's own checkpoint, quantised offline, are this module's fp8 job's
check through the same gather, and the int8 quantiser's bytes equal the converter's at unit level
(``tests/weight_sync``, ``tests/quant``).

The fp8-sync job also runs ``cosched`` (its evidence is separable: the dispatch counts in slime's rollout metrics,
which weight sync does not touch): with two slime-managed engines read from slime's router (``/workers``), each
rollout's requests are all dispatched by the plugin, spread over both engines, and none moves (no sessions). And its
engines decode speculatively (slime's ``--sglang-speculative-*`` flags, a draft model: the BF16 start checkpoint):
slime's own ``rollout/spec_accept_length`` / ``spec_accept_rate`` from the answers' SGLang fields, and each engine's log
of the accept length under each version it leaves.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import (
    job_env,
    make_model,
    make_prompts,
    run_slime,
    slime_flags,
    slime_src,
    start_engine,
    stop,
)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.slime_managed_engines,
              pytest.mark.timeout(1200)]

NUM_ROLLOUT = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")


def _cli(*argv: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-m", "slime_ascend.cli", *argv], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def quantize(src: Path, out: Path, fmt: str) -> Path:
    _cli("quantize", str(src), str(out), "--format", fmt)
    return out


def tensors(directory: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of the safetensors files in ``directory`` (or of that one file): name -> (dtype, shape, raw
    bytes)."""
    import torch
    from safetensors import safe_open

    out = {}
    for path in [directory] if directory.is_file() else sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                t = f.get_tensor(name).contiguous()
                assert name not in out, f"{name} in two files of {directory}"
                out[name] = (str(t.dtype), tuple(t.shape), t.view(torch.uint8).numpy().tobytes())
    return out


def assert_same_tensors(pushed: Path, reference: Path) -> None:
    got, want = tensors(pushed), tensors(reference)
    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))
    for name in want:
        assert got[name][:2] == want[name][:2], (name, got[name][:2], want[name][:2])
        assert got[name][2] == want[name][2], f"{name}: bytes differ between {pushed} and {reference}"


def model_info(url: str) -> dict:
    with urllib.request.urlopen(url + "/model_info", timeout=10) as resp:
        return json.loads(resp.read())


# slime's tools/convert_torch_dist_to_hf.py, driven through its own reader, planner and save_tensors. Its
# __main__ reads Megatron's args from iter_*/common.pt, which megatron-core 0.19 no longer writes: it keeps
# the common state inside the distributed checkpoint (key common_state/...), read here with the same reader.
_CONVERT = """
import runpy, sys
import torch.distributed.checkpoint as dcp
tool_path, iter_dir, out_dir, origin = sys.argv[1:]
tool = runpy.run_path(tool_path, run_name="slime_convert_torch_dist_to_hf")

class CommonState(dcp.default_planner.DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        for key, value in metadata.state_dict_metadata.items():
            if key.startswith("common_state"):
                state_dict[key] = value
        super().set_up_planner(state_dict, metadata, is_coordinator)

common = {}
dcp.state_dict_loader._load_state_dict(common, storage_reader=tool["WrappedStorageReader"](iter_dir),
                                       planner=CommonState(), no_dist=True)
(entry,) = common.values()
megatron_args = entry[0]["args"]
state_dict = {}
dcp.state_dict_loader._load_state_dict(state_dict, storage_reader=tool["WrappedStorageReader"](iter_dir),
                                       planner=tool["EmptyStateDictLoadPlanner"](), no_dist=True)
state_dict = {k: v for k, v in state_dict.items() if not hasattr(v, "read")}  # _extra_state / rng bytes
tool["save_tensors"](megatron_args, "qwen3", state_dict, out_dir, 5 * 1024**3)
tool["copy_assets"](origin, out_dir)
"""


def torch_dist_to_hf(ckpt: Path, origin_hf: Path, out: Path, plugins: tuple[str, ...],
                     iteration: int | None = None) -> Path:
    """slime's own converter (tools/convert_torch_dist_to_hf.py) of a Megatron checkpoint slime saved (``iteration``,
    default the newest): the HF weights of that step, in the dtype slime trained in."""
    latest = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() if iteration is None else iteration
    iter_dir = ckpt / f"iter_{int(latest):07d}"
    assert iter_dir.is_dir(), sorted(p.name for p in ckpt.iterdir())
    src = slime_src()
    proc = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(src / "tools" / "convert_torch_dist_to_hf.py"), str(iter_dir), str(out),
         str(origin_hf)],
        capture_output=True, text=True, env=job_env(plugins, src=src), cwd=str(out.parent), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _run_sync(model_dir: Path, tmp_path: Path, plugin: str, fmt: str):
    qdir = quantize(model_dir, tmp_path / f"tiny-qwen3-{fmt}", fmt)
    engine = start_engine(qdir, tmp_path / "engine.log")
    try:
        info0 = model_info(engine.url)
        plugins = ("cpu", plugin)
        config = tmp_path / "ascend.yaml"
        _cli("config", *plugins, "-o", str(config))
        prompts = make_prompts(tmp_path / "prompts.jsonl")
        flags = slime_flags(model_dir, prompts, [engine], tmp_path, num_rollout=NUM_ROLLOUT)
        # the engine's checkpoint is --hf-checkpoint (its format is what the plugin syncs); Megatron loads the
        # BF16 weights from --load
        at = flags.index("--hf-checkpoint")
        flags[at + 1] = str(qdir)
        flags.append("--update-weight-disk-keep-files")  # slime deletes each version after the reload otherwise
        run = run_slime("train.py", flags, tmp_path, plugins, custom_config=config)
        info = model_info(engine.url)
    finally:
        stop(engine.proc)
    assert run.returncode == 0, run.log[-6000:]
    return run, qdir, info0, info, engine.log.read_text()


def _check_run(run, model_dir: Path, qdir: Path, tmp_path: Path, plugin: str, fmt: str, info0, info, engine_log):
    plugins = ("cpu", plugin)
    # the plugin ran in the train actor, checked the engine's format and installed its patches
    assert any("MegatronTrainRayActor" in line and f"slime-ascend plugins active: cpu, {plugin}" in line
               for line in run.log.splitlines())
    assert f"{plugin}: rollout checkpoint {qdir} is {fmt}" in run.log
    for patch_id in ("train.quantize_params", "train.weight_sync_metrics"):
        assert f"applied runtime patch {patch_id}" in run.log

    # slime wrote one version before training and one after each step
    weights = tmp_path / "weights"
    versions = sorted(p.name for p in weights.iterdir())
    assert versions == [f"weight_v{v:06d}" for v in range(1, NUM_ROLLOUT + 2)], versions
    last = weights / versions[-1]

    # slime's perf metrics report the quantised sync: every linear weight quantised, fewer bytes sent
    syncs = [m for m in run.metrics() if "perf/weight_sync_bytes" in m]
    assert syncs, "slime logged no perf/weight_sync_* metrics"
    n_linear = 14  # 2 layers x (q, k, v, o, gate, up, down)
    for m in syncs:
        assert m["perf/weight_sync_quantized_params"] % n_linear == 0 and m["perf/weight_sync_quantized_params"] > 0
        assert 0 < m["perf/weight_sync_bytes"] < m["perf/weight_sync_source_bytes"], m

    # the engine loaded every version slime pushed, serves the last one, and reports its format
    assert info0["weight_version"] == "default" and info0.get("quantization") == fmt, info0
    assert info["model_path"] == str(last), info
    assert info["weight_version"] == str(NUM_ROLLOUT + 1), info
    assert info.get("quantization") == fmt, info
    for v, name in enumerate(versions, start=1):
        assert f"loaded weight version {v} from {weights / name} ({fmt})" in engine_log, engine_log[-3000:]

    # bytes: version 1 is the BF16 model slime loaded, before any training
    assert_same_tensors(weights / versions[0], quantize(model_dir, tmp_path / "ref-v1", fmt))
    # bytes: the last version is slime's own checkpoint of the last step, quantised offline
    bf16 = torch_dist_to_hf(tmp_path / "ckpt", model_dir, tmp_path / "ckpt-hf", plugins)
    assert_same_tensors(last, quantize(bf16, tmp_path / "ref-last", fmt))
    # and training changed the weights, so the comparison is not vacuous
    assert tensors(weights / versions[0]) != tensors(last)


@pytest.mark.all_cases
def test_int8_sync_over_disk_matches_offline_quantize(model_dir, tmp_path):
    plugin, fmt = "int8-sync", "int8-w8a8"
    run, qdir, info0, info, engine_log = _run_sync(model_dir, tmp_path, plugin, fmt)
    _check_run(run, model_dir, qdir, tmp_path, plugin, fmt, info0, info, engine_log)


NUM_ENGINES = 2


def slime_managed(flags: list[str], qdir: Path) -> list[str]:
    """:func:`slime_flags` (an external engine, the disk transport) without ``--rollout-external*`` (slime starts
    the engines) and without ``--update-weight-transport`` (slime's default), serving the quantised checkpoint
    ``qdir`` (``--hf-checkpoint``)."""
    flags = list(flags)
    at = flags.index("--rollout-external-engine-addrs")
    end = next(i for i in range(at + 1, len(flags)) if flags[i].startswith("--"))  # the addresses, if any
    del flags[at:end]
    at = flags.index("--update-weight-transport")
    assert flags[at + 1:at + 3] == ["disk", "--update-weight-disk-dir"], flags[at:at + 4]
    del flags[at:at + 4]
    flags[flags.index("--hf-checkpoint") + 1] = str(qdir)
    return flags


def _managed_distributed_flags(flags: list[str], qdir: Path, prompts: Path) -> list[str]:
    """:func:`slime_managed` flags on slime's default transport (``nccl``: ``update_weights_from_distributed``),
    ``NUM_ENGINES`` engines of one device each, and the probe as slime's eval after each push."""
    flags = slime_managed(flags, qdir)
    flags[flags.index("--rollout-num-gpus") + 1] = str(NUM_ENGINES)
    return flags + ["--eval-interval", "1", "--eval-prompt-data", "probe", str(prompts),
                    "--eval-function-path", "weight_probe.read_engines"]


def test_fp8_sync_over_slime_distributed_transport_with_managed_engines(model_dir, tmp_path):
    plugin, fmt = "fp8-sync", "fp8-block"
    plugins = ("cpu", "torch-engine", plugin, "cosched")
    qdir = quantize(model_dir, tmp_path / f"tiny-qwen3-{fmt}", fmt)
    config = tmp_path / "ascend.yaml"
    _cli("config", *plugins, "-o", str(config))
    # item 8: after the first push, each version goes as the fp8 blocks that changed (weight_sync.distributed_delta)
    text = config.read_text()
    assert "ascend_fp8_sync_distributed_delta: false" in text
    assert "ascend_fp8_sync_pipelined_send: false" in text
    # and each bucket is sent on a sender thread while the next is quantised (train.pipelined_weight_send)
    config.write_text(text.replace("ascend_fp8_sync_distributed_delta: false", "ascend_fp8_sync_distributed_delta: true")
                      .replace("ascend_fp8_sync_pipelined_send: false", "ascend_fp8_sync_pipelined_send: true"))
    prompts = make_prompts(tmp_path / "prompts.jsonl")
    flags = _managed_distributed_flags(slime_flags(model_dir, prompts, [], tmp_path, num_rollout=NUM_ROLLOUT), qdir,
                                       prompts)
    # speculative decoding on slime's engines, from slime's own --sglang-speculative-* flags: the draft is the BF16
    # model slime starts from, which no push changes
    flags += ["--sglang-speculative-algorithm", "STANDALONE", "--sglang-speculative-draft-model-path", str(model_dir),
              "--sglang-speculative-num-steps", "3", "--sglang-speculative-num-draft-tokens", "4"]
    probe = tmp_path / "probe"
    run = run_slime("train.py", flags, tmp_path, plugins, custom_config=config,
                    extra_env={"PYTHONPATH": str(Path(__file__).parent), "WEIGHT_PROBE_DIR": str(probe)})
    assert run.returncode == 0, run.log[-6000:]
    log = run.log
    versions = range(1, NUM_ROLLOUT + 2)  # one push before training, one after each step

    # the plugins ran in the train actor: the format checked, the quantiser and float8-over-gloo installed
    assert any("MegatronTrainRayActor" in line and f"slime-ascend plugins active: {', '.join(plugins)}" in line
               for line in log.splitlines())
    assert f"{plugin}: rollout checkpoint {qdir} is {fmt}" in log
    for patch_id in ("train.quantize_params", "train.weight_sync_metrics", "train.gloo_float8_broadcast",
                     "train.pipelined_weight_send", "engine.torch_engine_launch"):
        assert f"applied runtime patch {patch_id}" in log, patch_id

    # cosched: every rollout request went out through the plugin's dispatcher, to both of slime's engines
    assert "applied runtime patch rollout.cosched_generate" in log
    cosched = [m for m in run.metrics() if "rollout/cosched_requests" in m]
    assert len(cosched) == NUM_ROLLOUT, cosched
    requests = 4 * 2  # slime_flags' defaults: batch 4 prompts x 2 samples
    for m in cosched:
        dispatched = [m[f"rollout/cosched_engine{i}_dispatched"] for i in range(NUM_ENGINES)]
        assert m["rollout/cosched_requests"] == sum(dispatched) == requests and min(dispatched) > 0, m
        assert m["rollout/cosched_moves"] == 0, m
        assert all(0 < m[f"rollout/cosched_engine{i}_busy_fraction"] <= 1 for i in range(NUM_ENGINES)), m
    # speculative decoding: slime's own rollout metrics (from the SGLang meta-info fields every answer carries) and
    # each engine's account, as the next version comes in, of how the draft kept up with the version it leaves
    spec = [m for m in run.metrics() if "rollout/spec_accept_length" in m]
    assert len(spec) == NUM_ROLLOUT and all(m["rollout/spec_accept_length"] > 1 for m in spec), spec
    assert all(0 < m["rollout/spec_accept_rate"] <= 1 for m in spec), spec
    for v in range(1, NUM_ROLLOUT + 1):
        kept = re.findall(rf"speculative decoding under weight version {v}: accept length ([\d.]+)", log)
        assert len(kept) == NUM_ENGINES and all(float(x) > 1 for x in kept), (v, kept)
    # slime started the engines (its SGLangEngine actors), and nothing went through disk
    assert log.count("torch-engine: slime-managed engine starting on ") == NUM_ENGINES
    assert not any((tmp_path / "weights").iterdir())

    # slime's perf metrics report the quantised sync: every linear weight quantised, fewer bytes sent
    syncs = [m for m in run.metrics() if "perf/weight_sync_bytes" in m]
    assert len(syncs) == NUM_ROLLOUT, syncs
    for m in syncs:
        assert m["perf/weight_sync_quantized_params"] % 14 == 0 and m["perf/weight_sync_quantized_params"] > 0
        assert 0 < m["perf/weight_sync_bytes"] < m["perf/weight_sync_source_bytes"], m

    # each engine switched to every version from the broadcast (the first whole, each later one as a delta against
    # the one before: the changed blocks only), and the driver read every engine's version back
    for v in versions:
        switched = f"switched to weight version {v} from "
        lines = [line for line in log.splitlines() if switched in line]
        assert len(lines) == NUM_ENGINES, (v, lines)
        how = fmt if v == 1 else f"{fmt}, a delta against version {v - 1}"
        assert all(line.endswith(f"buckets of update_weights_from_distributed ({how})") for line in lines), lines
        # the train side's account of the push: a delta carries a fraction of the version's bytes
        sent = [line for line in log.splitlines() if f"weight version {v} serving on group slime-pp_0 " in line]
        assert len(sent) == 1, (v, sent)
        want = "whole" if v == 1 else f"delta against version {v - 1}"
        assert f"({NUM_ENGINES} engines): {want}, " in sent[0], sent
        density = float(sent[0].rsplit("(density ", 1)[1].rstrip(")"))
        assert (density == 1.0) if v == 1 else (0 < density < 1), sent
        assert f"weight version {v} acknowledged by every engine ({NUM_ENGINES}) after the push" in log, v

    # the probe (slime's eval, right after each push) read every engine: the version just pushed, acknowledged,
    # served before and after the read and carried by every answer
    reads = [json.loads(line) for line in (probe / "reads.jsonl").read_text().splitlines()]
    assert [(r["engine"], r["before"]) for r in reads] == [(i, str(v)) for v in versions for i in range(NUM_ENGINES)]
    n_tensors = len(tensors(qdir))
    for r in reads:
        assert r["after"] == r["before"] and r["answered"] == [r["before"]], r
        assert r["acknowledged"] == int(r["before"]) and r["tensors"] == n_tensors, r
    assert [m["eval/weight_probe"] for m in run.metrics() if "eval/weight_probe" in m] == \
        [float(NUM_ENGINES * n_tensors)] * len(versions)

    held = {(i, v): probe / f"engine{i}-v{v}.safetensors" for v in versions for i in range(NUM_ENGINES)}
    assert all(path.is_file() for path in held.values()), sorted(p.name for p in probe.iterdir())
    # bytes: version 1 is the BF16 model slime loaded, quantised; every engine holds the same
    ref_first = quantize(model_dir, tmp_path / "ref-v1", fmt)
    ref_last = quantize(torch_dist_to_hf(tmp_path / "ckpt", model_dir, tmp_path / "ckpt-hf", plugins),
                        tmp_path / "ref-last", fmt)
    for i in range(NUM_ENGINES):
        assert_same_tensors(held[i, 1], ref_first)
        assert_same_tensors(held[i, versions[-1]], ref_last)
        assert tensors(held[i, 2]) == tensors(held[0, 2])
    # float8 weights with their scales, and training changed them
    assert any(dtype == "torch.float8_e4m3fn" for dtype, _, _ in tensors(held[0, 1]).values())
    assert tensors(held[0, 1]) != tensors(held[0, versions[-1]])
