"""A weight sender in its own process, as slime's ``update_weight_from_distributed.py`` sends: rank 0 of a gloo
group with the engine, one ``/update_weights_from_distributed`` call per bucket (names, dtypes, shapes,
weight_version), then one broadcast per tensor of the bucket, while the call waits for them.

``python weight_sender.py PLAN.json``; the plan: ``url``, ``port`` (the group's rendezvous), ``group_name``,
``tensors`` (a safetensors file), ``buckets`` (lists of names), ``version``; optional ``stop_after`` (send only
that many buckets, then leave without destroying the group: a bucket missing), ``kill_in_bucket`` and
``kill_after`` (in that bucket, after its call was posted and ``kill_after`` of its tensors were broadcast, the
process kills itself with SIGKILL), ``stall_in_bucket`` (post that bucket's call and never broadcast: sleep),
``backend`` (what the init call asks for), ``via_train_patch`` (each bucket sent by the train side's own
function, slime's ``update_weights_from_distributed`` as the runtime patch ``train.gloo_float8_broadcast`` replaces
it, through a stand-in for slime's engine actor). Prints one JSON line per answer: ``{"call", "status", "body"}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import httpx
import torch
from safetensors.torch import load_file

from slime_ascend.rollout.torch_engine.weight_group import join_group, wire_view


def _post(url: str, payload: dict, out: list) -> threading.Thread:
    def run() -> None:
        with httpx.Client(trust_env=False, timeout=300) as client:  # no proxies for loopback
            resp = client.post(url, json=payload)
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        out.append({"call": url.rsplit("/", 1)[1], "status": resp.status_code, "body": body})
        print(json.dumps(out[-1]), flush=True)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


class _EngineActor:
    """What slime's SGLangEngine actor does with ``update_weights_from_distributed.remote(...)``: the HTTP call
    (dtypes as names, shapes as lists); the "ref" is the thread making it."""

    def __init__(self, url: str, answers: list) -> None:
        self.url, self.answers = url, answers
        self.update_weights_from_distributed = self

    def remote(self, names, dtypes, shapes, group_name, weight_version=None, load_format=None):
        payload = {"names": names, "dtypes": [str(d).replace("torch.", "") for d in dtypes],
                   "shapes": [list(s) for s in shapes], "group_name": group_name, "flush_cache": False,
                   "weight_version": weight_version}
        if load_format is not None:
            payload["load_format"] = load_format
        return _post(self.url + "/update_weights_from_distributed", payload, self.answers)


def main(plan_path: str) -> int:
    plan = json.loads(open(plan_path).read())
    url, answers = plan["url"], []
    tensors = load_file(plan["tensors"])
    init = {"master_address": "127.0.0.1", "master_port": plan["port"], "rank_offset": 1, "world_size": 2,
            "group_name": plan["group_name"], "backend": plan.get("backend", "gloo")}
    thread = _post(url + "/init_weights_update_group", init, answers)
    if init["backend"] != "gloo":
        thread.join()
        return 0
    group = join_group("127.0.0.1", plan["port"], 0, 2, plan["group_name"], "gloo", timeout_s=30)
    thread.join()
    for index, names in enumerate(plan["buckets"]):
        if plan.get("stop_after") is not None and index >= plan["stop_after"]:
            break
        bucket = [(name, tensors[name]) for name in names]
        meta = {"names": names, "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": plan["group_name"],
                "weight_version": str(plan["version"]), "flush_cache": False}
        if plan.get("via_train_patch"):  # the train side's own function (runtime patch train.gloo_float8_broadcast)
            from slime_ascend.patch.train.gloo_float8_broadcast import _replacement

            refs = _replacement(None)(plan["group_name"], group, plan["version"], [_EngineActor(url, answers)],
                                      bucket)
            for ref in refs:
                ref.join()
            continue
        thread = _post(url + "/update_weights_from_distributed", meta, answers)
        if plan.get("stall_in_bucket") == index:
            thread.join()  # the engine gives up on the missing tensors; its answer is printed
            time.sleep(1)
            return 0
        for sent, (_, tensor) in enumerate(bucket):
            if plan.get("kill_in_bucket") == index and sent == plan.get("kill_after", 0):
                time.sleep(0.5)  # the engine is inside its receive now
                os.kill(os.getpid(), signal.SIGKILL)
            torch.distributed.broadcast(wire_view(tensor.contiguous(), "gloo"), 0, group=group)
        thread.join()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    # a sender leaves as a process that dies does: no interpreter teardown, whose destructor of the gloo group
    # (never destroyed, the engine still joined) can abort the process (SIGABRT after the answers, seen on CI)
    sys.stdout.flush()
    os._exit(code)
