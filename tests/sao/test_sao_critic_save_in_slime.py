"""In slime's own driver: ``sao`` refuses at ``parse_args`` a critic that would save over the actor's checkpoint
(``--save`` with no critic ``save`` in ``--megatron-config-path``), before Ray starts, in one line naming the fix;
with the fix the same command line parses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from slime_ascend import config
from slime_ascend.sao import critic


def _parse(tmp_path: Path, role: Path) -> subprocess.CompletedProcess:
    from conftest import need
    from transformers import Qwen3Config

    need("slime.utils.arguments")
    if not (tmp_path / "hf").exists():
        Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    tie_word_embeddings=False).save_pretrained(tmp_path / "hf")
        (tmp_path / "ascend.yaml").write_text(config.build(["sao"]).yaml_text)
    flags = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
             "--num-query-groups 2 --kv-channels 16 --seq-length 256 --max-position-embeddings 256 "
             "--normalization RMSNorm --norm-epsilon 1e-6 --qk-layernorm --swiglu --disable-bias-linear "
             "--untie-embeddings-and-output-weights --position-embedding-type rope "
             "--vocab-size 1024 --micro-batch-size 1 --rollout-batch-size 4 --n-samples-per-prompt 1 "
             "--global-batch-size 4 --actor-num-nodes 1 --actor-num-gpus-per-node 1 --colocate --num-rollout 2 "
             "--advantage-estimator ppo --use-critic --critic-num-nodes 1 --critic-num-gpus-per-node 1").split()
    script = textwrap.dedent(f"""
        import sys, typing, typing_extensions
        typing.override = getattr(typing, "override", typing_extensions.override)
        sys.argv = ["train.py", "--hf-checkpoint", {str(tmp_path / 'hf')!r}, *{flags!r},
                    "--save", {str(tmp_path / 'ckpt')!r}, "--save-interval", "10", "--megatron-config-path", {str(role)!r},
                    "--custom-config-path", {str(tmp_path / 'ascend.yaml')!r}]
        from slime.utils.arguments import parse_args
        parse_args()
        print("PARSED")
    """)
    env = {**os.environ, "SLIME_ASCEND_PLUGINS": "sao", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)


def test_slimes_parse_args_refuses_a_critic_saving_over_the_actor(tmp_path):
    role = tmp_path / "sao_megatron.yaml"
    assert critic.main(["-o", str(role)]) == 0  # the freeze list only, as before the fix
    proc = _parse(tmp_path, role)
    assert proc.returncode == 2 and "PARSED" not in proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("slime-ascend: error:")]
    assert len(lines) == 1 and f"the critic would save into --save {tmp_path / 'ckpt'}" in lines[0], proc.stderr[-3000:]
    assert f"--merge {role} -o {role} --set save={tmp_path / 'ckpt'}_critic" in lines[0]
    assert "Traceback" not in proc.stderr

    # the fix the line names
    assert critic.main(["--merge", str(role), "-o", str(role), "--set", f"save={tmp_path / 'ckpt'}_critic"]) == 0
    proc = _parse(tmp_path, role)
    assert proc.returncode == 0 and "PARSED" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])
