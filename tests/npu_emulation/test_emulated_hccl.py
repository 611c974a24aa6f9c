"""The emulated ``hccl`` backend (slime_ascend.npu_emulation.hccl): collectives between two processes on ``npu``
tensors give the right values and leave the outputs on ``npu``; HCCL's environment is read and refused as HCCL
would (timeouts, port ranges, the all-cards rule of HCCL_NPU_SOCKET_PORT_RANGE)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import emulated_hccl_workers
import zygote
from emulated_process import environment
from slime_ascend.npu_emulation import hccl


def two_ranks(scenario: str, out: Path, env: dict | None = None) -> dict[int, dict]:
    zygote.spawn(emulated_hccl_workers.worker, args=(scenario, zygote.free_port(), str(out)), nprocs=2,
                 env=environment(env), timeout=300)
    return {rank: json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)}


def test_collectives_between_two_processes_are_right_and_stay_on_npu(tmp_path):
    results = two_ranks("collectives", tmp_path, {"HCCL_EXEC_TIMEOUT": "90"})
    for rank, r in results.items():
        assert r["backend"] == r["group_backend"] == "hccl"
        assert r["devices"] == [f"npu:{rank}"]
        assert r["all_reduce"] == [3.0] * 4 and r["new_group"] == [2.0, 2.0]
        assert r["all_gather"] == [0.0, 0.0, 1.0, 1.0]
        assert r["broadcast"] == [1.0] * 3 and r["batch_p2p"] == [float(1 - rank + 5)] * 2
        assert r["op_timeout_s"] == 120.0  # HCCL_EXEC_TIMEOUT + 30 s, inside the group's 30-minute timeout
    assert results[0]["reduce_scatter"] == [0.0, 3.0] and results[1]["reduce_scatter"] == [6.0, 9.0]
    assert results[0]["all_to_all"] == [0.0, 1.0, 10.0, 11.0] and results[1]["all_to_all"] == [2.0, 3.0, 12.0, 13.0]
    assert results[1]["send_recv"] == [42.0]


def test_npu_port_range_set_on_one_rank_only_fails_the_group_on_every_rank(tmp_path):
    results = two_ranks("npu_port_range_on_one_rank", tmp_path)
    for r in results.values():
        assert r["error"].startswith("HcclEnvError: HCCL_NPU_SOCKET_PORT_RANGE is set on rank(s) [0] but not on "
                                     "rank(s) [1]"), r
        assert "\n" not in r["error"]


def test_connect_timeout_is_read_as_hccl_reads_it():
    assert hccl.connect_timeout_s({}) == 140
    assert hccl.connect_timeout_s({"HCCL_CONNECT_TIMEOUT": "300"}) == 320
    for value, message in (("30", "accepts 120 to 7200"), ("2h", "integer number of seconds")):
        with pytest.raises(hccl.HcclEnvError, match=f"HCCL_CONNECT_TIMEOUT={value!r}: .*{message}"):
            hccl.connect_timeout_s({"HCCL_CONNECT_TIMEOUT": value})


def test_exec_timeout_is_read_as_torch_npu_reads_it():
    assert hccl.exec_timeout_s({}) == 1836 + 30
    assert hccl.exec_timeout_s({"HCCL_EXEC_TIMEOUT": "600"}) == 630
    assert hccl.exec_timeout_s({"HCCL_EXEC_TIMEOUT": "-5"}) == 1836 + 30  # negative: torch_npu's default
    assert hccl.exec_timeout_s({"HCCL_EXEC_TIMEOUT": "0"}) is None  # never times out


def test_port_ranges_follow_the_cann_format():
    assert hccl.parse_port_range("X", "auto") == "auto"
    assert hccl.parse_port_range("X", "60000-60050") == [(60000, 60050)]
    assert hccl.parse_port_range("X", "60000,60050-60100,60150-60160") == [(60000, 60000), (60050, 60100),
                                                                           (60150, 60160)]
    for bad in ("60000-59000", "0-10", "70000", "60000-60050,60040", "ports"):
        with pytest.raises(hccl.HcclEnvError, match=f"X={bad!r}"):
            hccl.parse_port_range("X", bad)


def test_all_cards_rule_only_for_the_npu_port_range():
    hccl.check_all_cards({0: {"HCCL_HOST_SOCKET_PORT_RANGE": "auto"}, 1: {}})
    hccl.check_all_cards({0: {"HCCL_NPU_SOCKET_PORT_RANGE": "61000"}})
    hccl.check_all_cards({0: {"HCCL_NPU_SOCKET_PORT_RANGE": "61000"}, 1: {"HCCL_NPU_SOCKET_PORT_RANGE": "61001"}})
    with pytest.raises(hccl.HcclEnvError, match=r"rank\(s\) \[1\] but not on rank\(s\) \[0, 2\]"):
        hccl.check_all_cards({0: {}, 1: {"HCCL_NPU_SOCKET_PORT_RANGE": "auto"}, 2: {}})
