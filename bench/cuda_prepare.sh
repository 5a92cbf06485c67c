#!/usr/bin/env bash
# Prepares bench/cuda_check.py's run on a GPU machine of the device tool (Python 3.12 there,
# with torch, numpy, tokenizers, jinja2, typer, tqdm, regex and nvcc, but not cffi, pycparser,
# gguf or a setuptools that reads this pyproject): fetches those as wheels into .whl/ (ignored
# by git, carried by the run), copies a small model into .gpu-data/ (ignored too) and prints
# the one command to run there, with `carry: [".whl", ".gpu-data"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "cffi==2.1.1" "pycparser==3.12" "gguf==0.19.0" "setuptools==80.9.0" "wheel==0.48.0"
# a small stored-type model for the LoRA fine-tune check (../shared does not travel)
grep -qx '/.gpu-data/' .git/info/exclude 2>/dev/null || echo '/.gpu-data/' >> .git/info/exclude
mkdir -p .gpu-data && cp ../shared/data/gguf/stories260K-Q8_0.gguf .gpu-data/
ls -la .whl .gpu-data
cat <<'CMD'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && GGTRAIN_CUDA=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . && python3 native/build_cuda.py && set -o pipefail && PYTHONUNBUFFERED=1 python3 bench/cuda_check.py --out $OUT 2>&1 | tee $OUT/log
CMD
