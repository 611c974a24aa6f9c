"""slime's own ``parse_args`` on a tiny dense Qwen3's command line, in a subprocess with the plugin bootstrap: what a
job's driver refuses (or accepts) before Ray starts, as ``train.py`` would."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

# a tiny Qwen3 (the checkpoint :func:`parse_args` writes), one colocated train rank, 2 rollouts
TINY_FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
              "--num-query-groups 2 --kv-channels 16 --seq-length 256 --max-position-embeddings 256 "
              "--normalization RMSNorm --norm-epsilon 1e-6 --qk-layernorm --swiglu --disable-bias-linear "
              "--untie-embeddings-and-output-weights --position-embedding-type rope "
              "--vocab-size 1024 --micro-batch-size 1 --rollout-batch-size 4 --n-samples-per-prompt 1 "
              "--global-batch-size 4 --actor-num-nodes 1 --actor-num-gpus-per-node 1 --colocate --num-rollout 2").split()


def parse_args(tmp_path: Path, plugins: list[str], *argv: str, pythonpath: tuple[str, ...] = ()
               ) -> subprocess.CompletedProcess:
    """slime's ``parse_args`` with ``SLIME_ASCEND_PLUGINS=plugins``, the YAML ``slime-ascend config plugins`` writes
    (``tmp_path/ascend.yaml``, made once) and a tiny HF checkpoint (``tmp_path/hf``), then ``argv``; prints
    ``PARSED`` when it returns. ``pythonpath``: folders the job imports from (a test's reward function)."""
    from conftest import need
    from transformers import Qwen3Config

    from slime_ascend import config

    need("slime.utils.arguments")
    if not (tmp_path / "hf").exists():
        Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    tie_word_embeddings=False).save_pretrained(tmp_path / "hf")
    if not (tmp_path / "ascend.yaml").exists():
        (tmp_path / "ascend.yaml").write_text(config.build(list(plugins)).yaml_text)
    script = textwrap.dedent(f"""
        import sys, typing, typing_extensions
        typing.override = getattr(typing, "override", typing_extensions.override)
        sys.argv = ["train.py", "--hf-checkpoint", {str(tmp_path / 'hf')!r}, *{TINY_FLAGS!r}, *{list(argv)!r},
                    "--custom-config-path", {str(tmp_path / 'ascend.yaml')!r}]
        from slime.utils.arguments import parse_args
        parse_args()
        print("PARSED")
    """)
    env = {**os.environ, "SLIME_ASCEND_PLUGINS": ",".join(plugins), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The one-line refusals the plugins printed (``slime-ascend: error: ...``)."""
    return [line for line in proc.stderr.splitlines() if line.startswith("slime-ascend: error:")]
