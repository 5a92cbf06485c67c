#!/usr/bin/env bash
# Prepares bench/cuda_check.py's run on a GPU machine of the device tool (Python 3.12 there,
# with torch, transformers, peft, numpy, tokenizers, jinja2, typer, tqdm, regex and nvcc, but
# not cffi, pycparser, gguf or a setuptools that reads this pyproject): fetches those as wheels
# into .whl/, copies the data the checks read into .gpu-data/ (both ignored by git, carried by
# the run) and prints the commands to run there.
#
# A call carries at most 64 MiB, and SmolLM2-135M-Instruct (94 MiB) is split in two: the first
# command carries the wheels, the small data and the model's first 40 MiB (kept in /tmp/gpu
# there), and runs every check; the second, sent at once (the machine stays warm ~30 s between
# calls), carries the rest in .gpu-data2/ and runs the LoRA comparison with HF + PEFT.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=../shared/data
for d in /.whl/ /.gpu-data/ /.gpu-data2/; do
    grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "cffi==2.1.1" "pycparser==3.12" "gguf==0.19.0" "setuptools==80.9.0" "wheel==0.48.0"
rm -rf .gpu-data .gpu-data2 && mkdir -p .gpu-data/mnist .gpu-data2
cp $DATA/gguf/stories260K-Q8_0.gguf $DATA/chat/dummy_conversation.json .gpu-data/
cp $DATA/mnist/train-*-idx*-ubyte.gz .gpu-data/mnist/
head -c 40M $DATA/models/SmolLM2-135M-Instruct.Q4_1.gguf > .gpu-data/smollm2.part0
tail -c +$((40 * 1024 * 1024 + 1)) $DATA/models/SmolLM2-135M-Instruct.Q4_1.gguf > .gpu-data2/smollm2.part1
SUM=$(sha256sum $DATA/models/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)
du -sh .whl .gpu-data .gpu-data2
cat <<CMD
# 1, carry [".whl", ".gpu-data"]:
mkdir -p /tmp/gpu && cp .gpu-data/smollm2.part0 .gpu-data/dummy_conversation.json /tmp/gpu/ && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && GGTRAIN_CUDA=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . && python3 native/build_cuda.py && set -o pipefail && PYTHONUNBUFFERED=1 python3 bench/cuda_check.py --out \$OUT --mnist .gpu-data/mnist 2>&1 | tee \$OUT/log
# 2, at once, carry [".gpu-data2"]:
export PYTHONPATH=/tmp/site && cat /tmp/gpu/smollm2.part0 .gpu-data2/smollm2.part1 > /tmp/gpu/smollm2.gguf && echo "$SUM  /tmp/gpu/smollm2.gguf" | sha256sum -c && set -o pipefail && PYTHONUNBUFFERED=1 python3 bench/cuda_check.py --out \$OUT --skip-ops --skip-e2e --skip-bench --smollm2 /tmp/gpu/smollm2.gguf --chat /tmp/gpu/dummy_conversation.json 2>&1 | tee \$OUT/log
CMD
