"""Two processes on the emulated device talking over the emulated ``hccl`` backend: test_emulated_hccl.py starts two
:func:`worker` processes through ``tests/zygote.py`` (forked from a server that has imported torch, not installed the
emulation: each worker installs it in its own process). Each worker writes ``<dir>/<rank>.json``."""

import json
import os


def collectives(rank: int, port: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.npu.set_device(rank)
    dist.init_process_group("hccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {"backend": dist.get_backend()}
    t = torch.full((4,), float(rank + 1), device="npu")
    dist.all_reduce(t)
    gathered = torch.empty(4, device="npu")
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank), device="npu"))
    scattered = torch.empty(2, device="npu")
    dist.reduce_scatter_tensor(scattered, torch.arange(4.0, device="npu") * (rank + 1))
    exchanged = torch.empty(4, device="npu")
    dist.all_to_all_single(exchanged, torch.arange(4.0, device="npu") + 10 * rank)
    broadcast = torch.full((3,), float(rank), device="npu")
    dist.broadcast(broadcast, src=1)
    received = torch.empty(2, device="npu")
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank + 5), device="npu"), 1 - rank),
           dist.P2POp(dist.irecv, received, 1 - rank)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if rank == 0:
        dist.send(torch.tensor([42.0], device="npu"), dst=1)
        single = torch.zeros(1, device="npu")
    else:
        single = torch.zeros(1, device="npu")
        dist.recv(single, src=0)
    work = dist.all_reduce(torch.ones(2, device="npu"), async_op=True)
    work.wait()
    group = dist.new_group([0, 1], backend="hccl")
    in_group = torch.ones(2, device="npu")
    dist.all_reduce(in_group, group=group)
    dist.barrier()
    results = {"all_reduce": t, "all_gather": gathered, "reduce_scatter": scattered, "all_to_all": exchanged,
               "broadcast": broadcast, "batch_p2p": received, "send_recv": single, "new_group": in_group}
    out.update({name: value.cpu().tolist() for name, value in results.items()})
    out["devices"] = sorted({str(value.device) for value in results.values()})
    out["group_backend"] = dist.get_backend(group)
    out["op_timeout_s"] = dist.distributed_c10d._get_default_group()._get_backend(
        torch.device("npu")).options._timeout.total_seconds()
    dist.destroy_process_group()
    return out


def npu_port_range_on_one_rank(rank: int, port: int) -> dict:
    import torch.distributed as dist

    if rank == 0:
        os.environ["HCCL_NPU_SOCKET_PORT_RANGE"] = "61000-61050"
    try:
        dist.init_process_group("hccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(exc).__name__}: {exc}"}
    dist.destroy_process_group()
    return {"error": None}


def worker(rank: int, scenario: str, port: int, out: str) -> None:
    import slime_ascend.npu_emulation as emulation

    emulation.install()
    result = globals()[scenario](rank, port)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
