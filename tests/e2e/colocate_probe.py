"""Each sample's served version next to the acknowledged one, written inside slime's own loop (the colocate e2e
test's ``--custom-rollout-log-function-path``: slime's RolloutManager calls it with every rollout's samples, right
after they were generated and before the ``staleness`` plugin judges them; the test puts this folder on the job's
PYTHONPATH).

One JSON line a sample goes to ``$WEIGHT_PROBE_DIR/samples.jsonl``: the rollout, the sample's index and group, its
``weight_versions`` (what the engine's answers reported: SGLang's ``meta_info.weight_version``) and the version the
driver acknowledged after the last push (``driver.acknowledged_collective_update``,
:mod:`slime_ascend.weight_sync.served_version`). Returns False: slime's own rollout logging runs as usual.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def log_samples(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    from slime_ascend.weight_sync import served_version

    out = Path(os.environ["WEIGHT_PROBE_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    acknowledged = served_version.acknowledged()
    with (out / "samples.jsonl").open("a") as f:
        for sample in samples:
            f.write(json.dumps({"rollout_id": rollout_id, "index": sample.index, "group_index": sample.group_index,
                                "weight_versions": list(sample.weight_versions), "acknowledged": acknowledged,
                                "status": str(getattr(sample.status, "value", sample.status))}) + "\n")
    return False
