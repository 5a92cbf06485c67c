#!/usr/bin/env bash
# Prepares bench/cuda_check.py's runs on a GPU machine of the device tool (Python 3.12 there,
# with torch, transformers, peft, numpy, tokenizers, jinja2, typer, tqdm, regex and pytest-xdist,
# but not cffi, pycparser or gguf), so that its minutes go to running, not building:
#   - both libraries are built here: the CPU extension (abi3, compiled without -march: it loads on
#     any x86-64 Python >= the one that built it) and the CUDA one (nvcc here; the CUDA runtime
#     linked statically, cuBLAS and the driver loaded at run time), and carried;
#   - nothing is installed there but three wheels: the package is this checkout's folders
#     linked under ggtrain/ (the layout setup.py maps) with the checkout on PYTHONPATH;
#   - the data the checks read is copied into folders git ignores, carried by the runs.
# A call carries at most 64 MiB, and SmolLM2-135M-Instruct (94 MiB) is split in two. Three calls,
# sent one right after the other (the machine stays warm ~30 s between calls; /tmp and the
# carried libraries stay while it does): 1 runs every check but the SmolLM2 one (about 2 minutes
# on an H100 after a start of under a minute), 2 stages the model's first part, 3 joins it and
# runs the LoRA comparison with HF + PEFT (about 2 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=../shared/data
for d in /.whl/ /.gpu-data/ /.gpu-data2/ /.gpu-data3/; do
    grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
GGTRAIN_NATIVE_WERROR=1 GGTRAIN_CUDA=0 python3 setup.py -q build_ext --inplace
GGTRAIN_NATIVE_WERROR=1 python3 native/build_cuda.py
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "cffi==2.1.1" "pycparser==3.12" "gguf==0.19.0"
rm -rf .gpu-data .gpu-data2 .gpu-data3 && mkdir -p .gpu-data/mnist .gpu-data2 .gpu-data3
cp $DATA/gguf/stories260K-Q8_0.gguf .gpu-data/
cp $DATA/mnist/train-*-idx*-ubyte.gz .gpu-data/mnist/
M=$DATA/models/SmolLM2-135M-Instruct.Q4_1.gguf
head -c 40M $M > .gpu-data2/smollm2.part0
tail -c +$((40 * 1024 * 1024 + 1)) $M > .gpu-data3/smollm2.part1
cp $DATA/chat/dummy_conversation.json .gpu-data3/
SUM=$(sha256sum $M | cut -d' ' -f1)
du -sh .whl .gpu-data .gpu-data2 .gpu-data3 native/_cpu*.so native/_cuda.so
LINK='for d in cli core native formats; do ln -sfn ../$d ggtrain/$d; done'
cat <<CMD
# 1, carry [".whl", ".gpu-data", "native/_cpu.abi3.so", "native/_cuda.so"], timeout_s 300:
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:\$PWD || exit 1; $LINK; set -o pipefail; PYTHONUNBUFFERED=1 timeout 280 python3 bench/cuda_check.py --out \$OUT --mnist .gpu-data/mnist 2>&1 | tee \$OUT/log
# 2, at once, carry [".gpu-data2"]:
mkdir -p /tmp/gpu && cp .gpu-data2/smollm2.part0 /tmp/gpu/
# 3, at once, carry [".gpu-data3"], timeout_s 240:
export PYTHONPATH=/tmp/site:\$PWD; $LINK; cat /tmp/gpu/smollm2.part0 .gpu-data3/smollm2.part1 > /tmp/gpu/smollm2.gguf && echo "$SUM  /tmp/gpu/smollm2.gguf" | sha256sum -c || exit 1; set -o pipefail; PYTHONUNBUFFERED=1 timeout 220 python3 bench/cuda_check.py --out \$OUT --skip-ops --skip-e2e --skip-bench --smollm2 /tmp/gpu/smollm2.gguf --chat .gpu-data3/dummy_conversation.json 2>&1 | tee \$OUT/log
CMD
