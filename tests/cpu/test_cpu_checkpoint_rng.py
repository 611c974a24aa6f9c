"""The cpu plugin saves Megatron checkpoints without RNG state (``--no-save-rng``), so ``--load`` of them works.

On the host Megatron's RNG tracker is the inference tracker (``--inference-rng-tracker``), which keeps no states;
a checkpoint saved with RNG would carry empty ``rng_tracker_states``, and Megatron's ``load_checkpoint`` exits on
those ("Unable to load rng state from checkpoint ..."), so slime's ``train.py --load`` of its own ``--save``
stopped in the train actor. A checkpoint saved with ``--no-save-rng`` records that, and Megatron's load skips
the RNG for it. The whole stop/resume runs in ``tests/e2e/test_slime_faults.py``."""

import argparse
import inspect
import json
import shlex

from conftest import need, run_python
from slime_ascend import config
from slime_ascend.cpu import plugin


def _flag(text: str):
    return next(f for f in plugin.PLUGIN.command_line if f.flag == text)


def test_config_cpu_flags_carry_no_save_rng_and_the_check_refuses_its_absence():
    words = shlex.split(config.build(["cpu"]).flags_line())
    assert "--inference-rng-tracker" in words and "--no-save-rng" in words
    flag = _flag("--no-save-rng")
    assert flag.check(argparse.Namespace(no_save_rng=True)) is True
    assert flag.check(argparse.Namespace(no_save_rng=False)) is False
    assert flag.check(argparse.Namespace()) is False


def test_the_inference_tracker_keeps_no_states_and_megatron_skips_rng_of_a_checkpoint_saved_without():
    need("megatron.core", "Megatron-core: bash scripts/install-slime-cpu.sh")
    proc = run_python(
        "import json, socket, torch, torch.distributed as dist\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', world_size=1, rank=0)\n"
        "from megatron.core import parallel_state as mpu, tensor_parallel\n"
        "mpu.initialize_model_parallel(1, 1)\n"
        "tensor_parallel.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)\n"
        "print(json.dumps(sorted(tensor_parallel.get_cuda_rng_tracker().get_states())), flush=True)\n"
        "import os; os._exit(0)\n",  # no interpreter teardown: the gloo group's destructor can abort at exit
        env={"SLIME_ASCEND_PLUGINS": "cpu"}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []  # what a checkpoint's RNG would carry here

    from megatron.training import checkpointing

    load = inspect.getsource(checkpointing.load_checkpoint)
    save = inspect.getsource(checkpointing)
    assert "if not rng_state['rng_tracker_states']:" in load and "raise KeyError" in load  # empty: exit
    assert "not getattr(ckpt_args, 'no_save_rng', False)" in load  # saved without: RNG ignored at load
    assert "if not args.no_save_rng and rng_state:" in save  # --no-save-rng: nothing saved
