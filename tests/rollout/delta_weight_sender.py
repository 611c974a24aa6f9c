"""The train side of a delta push in its own process: rank 0 of a gloo group with the engine, several weight
versions pushed in a row through :class:`slime_ascend.weight_sync.distributed_delta.DeltaSender` (the function the
runtime patch ``train.gloo_float8_broadcast`` calls with a sync plugin's ``distributed_delta`` on), through a
stand-in for slime's engine actor (the HTTP call slime's ``SGLangEngine`` makes).

``python delta_weight_sender.py PLAN.json``; the plan: ``url``, ``port``, ``group_name``, ``pushes`` (each:
``version``, ``tensors`` (a safetensors file), ``buckets`` (lists of names), optional ``held_as`` (before this
push, relabel the version the sender holds, as if the engine had been replaced) and ``held_from`` (``{"version",
"tensors"}``: before this push, the sender holds that file's tensors as that version, as if every engine had
acknowledged serving them)). Prints one JSON line per call:
``{"version", "load_format", "status", "body"}``, and ``{"density": ...}`` after each push.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
from safetensors.torch import load_file

from slime_ascend.rollout.torch_engine.weight_group import join_group
from slime_ascend.weight_sync.distributed_delta import DeltaSender, _Version

POOL = ThreadPoolExecutor(4)


class _EngineActor:
    """slime's SGLangEngine.update_weights_from_distributed: the HTTP call (dtypes as names); the ref is a future
    of the answer's JSON (raising on an HTTP error, as slime's ``_make_request`` does)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.update_weights_from_distributed = self

    def remote(self, names, dtypes, shapes, group_name, weight_version=None, load_format=None) -> Future:
        payload = {"names": names, "dtypes": [str(d).replace("torch.", "") for d in dtypes],
                   "shapes": [list(s) for s in shapes], "group_name": group_name, "flush_cache": False,
                   "weight_version": weight_version}
        if load_format is not None:
            payload["load_format"] = load_format

        def call():
            with httpx.Client(trust_env=False, timeout=300) as client:
                resp = client.post(self.url + "/update_weights_from_distributed", json=payload)
            print(json.dumps({"version": weight_version, "load_format": load_format, "status": resp.status_code,
                              "body": resp.json()}), flush=True)
            resp.raise_for_status()
            return resp.json()

        return POOL.submit(call)


def main(plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    url, group_name = plan["url"], plan["group_name"]
    init = {"master_address": "127.0.0.1", "master_port": plan["port"], "rank_offset": 1, "world_size": 2,
            "group_name": group_name, "backend": "gloo"}
    answer = POOL.submit(lambda: httpx.Client(trust_env=False, timeout=60).post(url + "/init_weights_update_group",
                                                                                json=init))
    group = join_group("127.0.0.1", plan["port"], 0, 2, group_name, "gloo", timeout_s=30)
    assert answer.result().status_code == 200, answer.result().text
    sender, engine = DeltaSender(), _EngineActor(url)
    for push in plan["pushes"]:
        if push.get("held_from") is not None:
            held = push["held_from"]
            sender._received(group_name, _Version(held["version"]), sorted(load_file(held["tensors"]).items()),
                             [{"serving": True, "weight_version": held["version"]}])
        if push.get("held_as") is not None:
            sender.held[group_name].version = push["held_as"]
        tensors = load_file(push["tensors"])
        densities = []
        for names in push["buckets"]:
            sender.last_density = None
            sender.push_bucket(group_name, group, push["version"], [engine], [(n, tensors[n]) for n in names],
                               get=lambda refs: [r.result() for r in refs])
            densities.append(sender.last_density)
        print(json.dumps({"version": push["version"], "density": densities}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
