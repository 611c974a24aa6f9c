"""Two processes of one HCCL communicator on the emulated Ascend device (slime_ascend.npu_emulation): rank 0 an
engine with the sglang-npu launch bridge's environment, rank 1 a train actor as it starts (two :func:`worker`
processes, started by test_sglang_npu_hccl.py through ``tests/zygote.py``: forked from a server that has imported
torch, each installs the emulation in its own process; one ``rank<N>.json`` each in the out dir). The emulated hccl backend
fails a group whose ranks disagree on setting HCCL_NPU_SOCKET_PORT_RANGE, as CANN documents."""

import json
import os
import types

PORT_ENVS = ("HCCL_HOST_SOCKET_PORT_RANGE", "HCCL_NPU_SOCKET_PORT_RANGE")


def worker(rank: int, scenario: str, port: int, out: str) -> None:
    import slime_ascend.npu_emulation as emulation
    from slime_ascend.rollout.backends import sglang_npu

    emulation.install()
    for name in PORT_ENVS:  # the job exported none of them
        os.environ.pop(name, None)
    args = types.SimpleNamespace(ascend_plugins="npu,sglang-npu")
    backend = sglang_npu.BACKEND
    if rank == 0:  # engine.sglang_npu_launch, in the engine actor before it spawns SGLang
        sglang_npu.apply_env(backend.env(backend.options_from_args(args)))
    elif scenario == "train_actor_starts":  # train.hccl_port_env, as TrainRayActor.init starts
        sglang_npu.apply_train_env(args)
    import torch
    import torch.distributed as dist

    torch.npu.set_device(rank)
    result = {"env": {name: os.environ.get(name) for name in PORT_ENVS}}
    try:
        dist.init_process_group("hccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        t = torch.ones(2, device="npu")
        dist.all_reduce(t)
        result.update(error=None, all_reduce=t.cpu().tolist())
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
