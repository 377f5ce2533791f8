#!/usr/bin/env bash
# Device side of a GPU session, as ONE call of the device tool (timeout_s 600) with carry
# [".whl", ".ref"], after bench/fetch_wheels.sh here:
#   bash bench/gpu_session.sh [all|tests|bench|memory]
# all (default): everything below in one call, the GPU tests cut at 95 s (the kernel and probe
# tests come first; the engine, compile-matrix and resume tests need about 5-7 min more);
# tests: only step 1, with GPU_TESTS_S (default 540) for the whole GPU-marked set;
# bench: steps 2-5 only. A session with the device's 15 minutes runs `tests` or `bench`, not both.
# memory: step 6 only (issue 54, about 6 min): the estimate against the probe's peak at three
# micro-batch sizes, a 200m launch with batch.micro_batch auto, and one that runs out of memory
# for real at a size too large and goes on at the smaller one (memory.json, launch_*.log).
# Order: correctness first (a fast wrong kernel is no result), then the kernel and step
# benchmarks, the anchor as measured in November, and a real launch's own tokens/s. Every step
# has a timeout and writes into $OUT (or ./gpu-out) as it goes, so a run cut short still returns
# what finished. Budget: ~15 s of installs + the timeouts below (95 + 45 + 245 + 55 + 100 = 540 s)
# fit one 600 s call. At most 8 files come back: session.log holds every step's text output.
set -uo pipefail
PART=${1:-all}
case "$PART" in all) GPU_TESTS_S=${GPU_TESTS_S:-95} ;; tests) GPU_TESTS_S=${GPU_TESTS_S:-540} ;; bench|memory) ;;
  *) echo "usage: bash bench/gpu_session.sh [all|tests|bench|memory]" >&2; exit 2 ;; esac
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/session.log"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 DS_BUILD_OPS=0 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
step() { echo; echo "=== $* ($(date -u +%T))"; }
step install > "$LOG"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >> "$LOG" 2>&1 || { tail -20 "$LOG"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/proj . \
  >> "$LOG" 2>&1 || { tail -20 "$LOG"; exit 1; }
export PYTHONPATH=/tmp/proj:/tmp/site PATH=/tmp/site/bin:$PATH  # the deepspeed launcher (pip --target puts scripts in bin/)
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  git rev-parse --short HEAD 2>/dev/null || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee -a "$LOG"

if [ "$PART" = memory ]; then
# 6. Memory (issue 54). a) the estimate against the probe's measured peak at three sizes;
step "bench_memory" | tee -a "$LOG"
timeout 120 python3 bench/bench_memory.py --micro-batches 4,8,16 --json "$OUT/memory.json" 2>&1 | tail -20 | tee -a "$LOG"
rm -rf /tmp/syn && python3 bench/synthetic_corpus.py /tmp/syn --steps 32 >> "$LOG" 2>&1
SYN=(--set data.plan=/tmp/syn/plan.json --set data.shards_dir=/tmp/syn/shards --set data.target_tokens=null
     --set data.tokenizer=null --set data.seq_len=2048 --set training.max_steps=3 --set training.log_every=1
     --set training.export_final=false --set checkpoint.packs=null --set checkpoint.every_steps=3)
# b) one 200m launch with batch.micro_batch auto (16 rows of 2048 per step: candidates 16, 8, 4, 2, 1)
step "launch 200m micro_batch auto" | tee -a "$LOG"
timeout 150 deepspeed --num_gpus 1 --master_port 29534 launch/train.py --config ds_configs/200m/pretrain.yaml \
  "${SYN[@]}" --set batch.micro_batch=auto --set batch.global_tokens=32768 --set output_dir=/tmp/auto200m 2>&1 \
  | grep -v -E "Warning|warn\(" > "$OUT/launch_auto.log"; echo "exit ${PIPESTATUS[0]}" >> "$OUT/launch_auto.log"
grep -E "micro_batch auto|fits|estimated peak|throughput|finished|exit " "$OUT/launch_auto.log" | tee -a "$LOG"
# c) one launch at a size too large for this device (the estimate over its memory): a real
#    torch.OutOfMemoryError in step 1, retried in place at the smaller size (ZeRO 1, one rank)
MEM_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1 | awk '{print int($1/1024)}')
BIG=64; [ "$MEM_GIB" -gt 100 ] && BIG=128
step "launch 200m out of memory at micro-batch $BIG ($MEM_GIB GiB device)" | tee -a "$LOG"
timeout 200 deepspeed --num_gpus 1 --master_port 29535 launch/train.py --config ds_configs/200m/pretrain.yaml \
  "${SYN[@]}" --set batch.micro_batch=$BIG --set batch.global_tokens=$((BIG * 2048)) --set output_dir=/tmp/oom200m 2>&1 \
  | grep -v -E "Warning|warn\(" > "$OUT/launch_oom.log"; echo "exit ${PIPESTATUS[0]}" >> "$OUT/launch_oom.log"
grep -E "out of device memory|in force|throughput|finished|exit " "$OUT/launch_oom.log" | tee -a "$LOG"
cp /tmp/oom200m/micro_batch.json "$OUT/oom_micro_batch.json" 2>/dev/null || true
step done | tee -a "$LOG"
exit 0
fi

if [ "$PART" != bench ]; then
# 1. Every GPU-marked test of the suite (skipped on CPU). pytest runs from a copy of the tests, so
#    `ds_trhash` comes from /tmp/proj (where kernels/ is ds_trhash.kernels), not from the source
#    tree in the working directory. The junit XML names each test's outcome and time.
step "pytest -m gpu" | tee -a "$LOG"
#    Only the files that mark a test `gpu` are collected (collecting the whole suite costs time).
rm -rf /tmp/run && mkdir -p /tmp/run && cp -r tests pytest.ini ds_configs launch bench /tmp/run/
GPU_FILES=$(grep -rl --include='*.py' "mark.gpu" tests | sort)
echo "$GPU_FILES" | tee -a "$LOG"
(cd /tmp/run && timeout "$GPU_TESTS_S" python3 -m pytest -q -p no:cacheprovider -m gpu $GPU_FILES -rfEs --durations=15 \
  --junitxml="$OUT/gpu_tests.xml" 2>&1 | tail -60) | tee -a "$LOG"
fi
[ "$PART" = tests ] && { step done | tee -a "$LOG"; exit 0; }

# 2. Routed-expert kernels and head losses at N = 32,768, bf16
step bench_kernels | tee -a "$LOG"
timeout 45 python3 bench/bench_kernels.py --json "$OUT/bench_kernels.json" 2>&1 | tail -40 | tee -a "$LOG"

# 3. One optimizer step of 200m at 2048 x 16, bf16, each case in its own process: the anchor
#    (plain PyTorch, masked experts, autocast, torch.compile), the engine, the hand loop with the
#    engine's kernels, the engine with kernels.compile layers and model.
step bench_step | tee -a "$LOG"
timeout 245 python3 bench/bench_step.py --cases compile_masked,engine,manual,engine_compile,engine_compile_model \
  --warmup 2 --steps 8 --case-timeout 100 --json "$OUT/bench_step.json" 2>&1 \
  | grep -v -E "Warning|warn\(|^\s*$" | tail -80 | tee -a "$LOG"

# 4. The November anchor itself (../shared/bench/ref_step.py, carried in .ref/), beside the bench
step "ref_step.py compile_masked" | tee -a "$LOG"
if [ -f .ref/ref_step.py ]; then
  BATCHES=16 timeout 55 python3 .ref/ref_step.py compile_masked 2>&1 | grep '^{' | tee "$OUT/ref_step.jsonl" | tee -a "$LOG"
else
  echo "no .ref/ref_step.py: run bench/fetch_wheels.sh here and carry .ref" | tee -a "$LOG"
fi

# 5. A real launch of the bench's shape (ds_configs/200m/pretrain.yaml: 200m, bf16, ZeRO 1, kernels
#    auto; seq 2048, micro-batch 16, grad_accum 1) through the deepspeed launcher, on a synthetic
#    corpus (the embedded one holds 4 such steps), 30 steps with checkpoints at 15 and 30: its
#    end line "throughput: steady N tokens/s" (warm-up and checkpoint steps out) against the
#    bench's engine case.
step "launch 200m" | tee -a "$LOG"
rm -rf /tmp/launch200m /tmp/syn
python3 bench/synthetic_corpus.py /tmp/syn --steps 32 >> "$LOG" 2>&1
timeout 100 deepspeed --num_gpus 1 --master_port 29533 launch/train.py --config ds_configs/200m/pretrain.yaml \
  --set data.plan=/tmp/syn/plan.json --set data.shards_dir=/tmp/syn/shards --set data.target_tokens=null \
  --set data.tokenizer=null --set data.seq_len=2048 --set batch.micro_batch=16 --set batch.global_tokens=32768 \
  --set training.max_steps=30 --set training.log_every=5 --set training.export_final=false \
  --set checkpoint.every_steps=15 --set checkpoint.packs=null --set checkpoint.keep_last=1 \
  --set output_dir=/tmp/launch200m 2>&1 | grep -v -E "Warning|warn\(" | tail -40 | tee -a "$LOG"
cp /tmp/launch200m/metrics.csv "$OUT/launch_metrics.csv" 2>/dev/null || true
step done | tee -a "$LOG"
