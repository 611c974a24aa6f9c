"""What every slime-managed rollout engine holds after each weight push, read inside slime's own loop (the weight
sync e2e test's ``--eval-function-path``: slime's RolloutManager imports it; the test puts this folder on the
job's PYTHONPATH).

slime's ``train.py`` runs its eval right after each ``update_weights`` (``--eval-interval 1``, and once before
training, after the first push), while no rollout runs, so what the engines hold then is the version just
pushed. This eval generates nothing: for each engine the router lists (``GET /workers``) it reads the served
version (``/get_weight_version``) and every tensor of the rollout checkpoint (``--hf-checkpoint``'s names) with
``/get_weights_by_name`` and ``return_raw`` (the exact bytes), and writes them, as the engine answered them, to
``$WEIGHT_PROBE_DIR/engine{i}-v{version}.safetensors``; one JSON line a read goes to
``$WEIGHT_PROBE_DIR/reads.jsonl``: the engine, the version it served (before and after the read, and the one each
answer carries) and the version the driver acknowledged for the push (``driver.acknowledged_collective_update``,
:mod:`slime_ascend.weight_sync.served_version`). The eval's only metric is the number of tensors read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from slime_ascend.json_client import request_json


def _names(checkpoint: str) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return sorted(names)


def read_engines(args, rollout_id, data_source=None, evaluation=True):
    from safetensors.torch import save_file
    from slime.rollout.base_types import RolloutFnEvalOutput

    from slime_ascend.rollout.torch_engine.weight_read import decode_raw
    from slime_ascend.weight_sync import served_version

    out = Path(os.environ["WEIGHT_PROBE_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    router = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
    urls = sorted(w["url"] for w in request_json(router + "/workers")["workers"])
    acknowledged = served_version.acknowledged()
    names = _names(args.hf_checkpoint)
    read = 0
    for i, url in enumerate(urls):
        before = request_json(url + "/get_weight_version")["weight_version"]
        tensors, answered = {}, set()
        for name in names:
            answer = request_json(url + "/get_weights_by_name",
                                  {"name": name, "truncate_size": 1 << 30, "return_raw": True})
            answered.add(answer["weight_version"])
            tensors[name] = decode_raw(answer).clone()
        after = request_json(url + "/get_weight_version")["weight_version"]
        save_file(tensors, str(out / f"engine{i}-v{before}.safetensors"))
        read += len(tensors)
        with (out / "reads.jsonl").open("a") as f:
            f.write(json.dumps({"rollout_id": rollout_id, "engine": i, "url": url, "before": before, "after": after,
                                "answered": sorted(answered), "acknowledged": acknowledged,
                                "tensors": len(tensors)}) + "\n")
    return RolloutFnEvalOutput(data={"weight_probe": {"rewards": [float(read)]}})
