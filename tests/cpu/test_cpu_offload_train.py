"""The cpu plugin turns slime's train offload off (found by tests/e2e/test_slime_sao.py).

slime forces ``offload_train`` for PPO (``--advantage-estimator ppo``) and then LD_PRELOADs
torch_memory_saver's CUDA hook library into every train actor; without libcuda the Ray worker dies
before it registers ("worker startup repeatedly failed"). slime applies ``--custom-config-path`` after
that rule, so the YAML's ``offload_train: false`` wins.
"""

import yaml

from slime_ascend import config
from slime_ascend.cpu.plugin import PLUGIN


def test_cpu_plugin_sets_offload_train_false():
    assert dict(PLUGIN.slime_args)["offload_train"] is False


def test_generated_yaml_carries_it_with_sao():
    assert yaml.safe_load(config.build(["cpu", "sao"]).yaml_text)["offload_train"] is False
