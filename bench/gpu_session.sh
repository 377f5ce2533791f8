#!/usr/bin/env bash
# Device side of a GPU session, as ONE call of the device tool with carry [".whl"]:
#   bash bench/gpu_session.sh
# Order: correctness first (a fast wrong kernel is no result), then the kernel and step
# benchmarks. Everything lands in $OUT (or ./gpu-out) and is rewritten as results come in, so a
# run cut short still returns what finished. Budget: the timeouts below add up to
# 565 s, inside one 600 s device call (installs take the rest).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 DS_BUILD_OPS=0 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/proj . || exit 1
export PYTHONPATH=/tmp/proj:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
# 1. GPU correctness: the bf16 kernel tests and Liger RMSNorm (skipped on CPU). pytest runs from
#    a copy of the tests, so `ds_trhash` comes from /tmp/proj (where kernels/ is ds_trhash.kernels)
#    and not from the source tree in the working directory.
OUT_ABS=$(cd "$OUT" && pwd)
rm -rf /tmp/run && mkdir -p /tmp/run && cp -r tests pytest.ini ds_configs launch /tmp/run/
(cd /tmp/run && timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/model 2>&1 \
  | tail -30 | tee "$OUT_ABS/gpu_tests.log")
# 2. routed-expert kernels and head losses
timeout 80 python3 bench/bench_kernels.py --json "$OUT/bench_kernels.json" 2>&1 | tee "$OUT/bench_kernels.log"
# 3. packed-document attention at 200m / 2048 x 16, bf16: dense mask vs blockwise vs flex (memory)
timeout 45 python3 bench/bench_attention.py --device cuda --micro-batch 16 --precision bf16 \
  --json "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.log"
# 4. one optimizer step of 200m at 2048 x 16, bf16: engine, manual, compile, eager, and the engine
#    with kernels.compile layers and model (engine_compile, engine_compile_model)
timeout 320 python3 bench/bench_step.py --json "$OUT/bench_step.json" 2>&1 | tee "$OUT/bench_step.log"
