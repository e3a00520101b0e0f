#!/bin/sh
# The pure-Python wheels a lent GPU machine lacks for benchmarks/gpu_check.py, into .whl/ at
# the repository's root (git-ignored), for a device call to carry and install.
#
# The lent H200's image has torch, accelerate, safetensors, transformers, peft, matplotlib,
# tensorboard and imageio, but not diffusers; transformers and peft are carried too, at the
# versions the kit is tested with. The check needs nothing the notebooks need (ipywidgets,
# papermill). Then, in one device call carrying .whl:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 &&
#   python3 benchmarks/gpu_check.py --compare-sdxl --no-cases --budget 500 \
#     --work-dir /tmp/kit-gpu-check --out $OUT/gpu_check.md
#
# and `python benchmarks/gpu_check.py --fill-readme FILE` here with the table that comes back.
# transformers 5.24 asks for regex>=2025.10.22, tokenizers 0.23 and huggingface_hub>=1.31: if an
# import fails there, `python3 -m pip show regex tokenizers huggingface_hub` says which to carry.
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  -d .whl diffusers==0.42.1 transformers==5.24.0 peft==0.21.2
ls -l .whl
