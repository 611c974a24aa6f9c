#!/usr/bin/env bash
# What slime's own train.py / train_async.py import on a CPU-only host (Python 3.11, x86_64), at slime's
# pins, plus this package with its test and docs extras (tests/test_docs.py builds the site). Used by .ci/run and by docs/cpu.md ("What slime
# needs on the host"). It installs packages only; it never installs a package named `slime` (the PyPI namesake is
# an unrelated project: real slime is a source tree on PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python -m pip "$@"; }

# torch: sglang 0.5.15 imports torchvision at start, and PyPI's torchvision only loads beside a
# matching torch (a CPU-only host simply has no CUDA device)
pip install -q "torch==2.14.1" "torchvision==0.29.1"
# transformers at slime's pin from the first install on: a newer one pulled in by the test extras brings
# packages of its own (kernels 0.19) that stay behind when the pin below downgrades it, and transformers 5.12.1
# does not import beside them (kernels' LayerRepository wants a revision that 5.12.1 does not give)
pip install -q -e ".[test,docs]" "transformers==5.12.1"
# slime's runtime imports on its tested paths (train.py / train_async.py, the rollout manager,
# the router), then the pinned packages without their dependency trees; ipython: sglang.utils imports
# IPython.display at start (every sglang import passes through it)
pip install -q "transformers==5.12.1" "sglang-router>=0.3.0" torch_memory_saver pybase64 "httpx[http2]" \
  omegaconf blobfile pylatexenc xxhash zstandard tensorboard wandb openai partial_json_parser msgspec \
  sentencepiece pyzmq dill einops triton orjson setproctitle uvloop gguf ipython
pip install -q --no-deps "sglang==0.5.15.post1"
# megatron-core with megatron.training: 0.19.2 is published for Python >= 3.12 only, as a cp312
# wheel whose one compiled file (datasets' helpers_cpp) slime does not use; its Python code runs on
# 3.11 (the cpu plugin adds typing.override there). Unpack it into site-packages.
if ! python -c "import megatron.core, sys; sys.exit(megatron.core.__version__ != '0.19.2')" >/dev/null 2>&1; then
  pip uninstall -q -y megatron-core >/dev/null 2>&1 || true
  wheel_dir=$(mktemp -d)
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$wheel_dir" "megatron-core==0.19.2"
  site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  python -m zipfile -e "$wheel_dir"/megatron_core-0.19.2-*.whl "$site"
  rm -rf "$wheel_dir"
fi
pip install -q "numpy<2"   # slime asserts numpy 1.x; last, since other packages pull numpy 2
