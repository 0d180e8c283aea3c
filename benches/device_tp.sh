#!/usr/bin/env bash
# Multi-GPU run (nvidia-h200-x2 / -x4): the NCCL tensor-parallel suites, the TP=1/2/4 timing at
# N=4096, D=2048, V=131072 (bf16), one thread per GPU and one process per GPU, and optionally extra single-GPU checks. Expects the stripped
# binaries (xz) in .gpu/ (gpu_tp, tp_linear_logp, and gpu for MODE large); logs go to $OUT.
set -uo pipefail
cd .gpu && for f in *.xz; do [[ -e $f ]] && xz -d -f "$f"; done && chmod +x ./* && cd ..
export BURN_INVARIANT_REQUIRE_CUDA=1 CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
nvidia-smi --query-gpu=index,name,driver_version --format=csv > "$OUT/device.txt"; nvidia-smi topo -m >> "$OUT/device.txt" 2>&1; date -u >> "$OUT/device.txt"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; (time timeout "$limit" "$@") > "$OUT/$name.log" 2>&1; echo "rc=$?"; grep -E "test result|FAILED|^RESULT|^tp world|^single|bitwise|panicked|^OK" "$OUT/$name.log" | head -40; }
GPUS=$(nvidia-smi -L | wc -l)
# `$1`: all, or a comma-separated list of tests, bench, large (default: tests,bench).
MODE=${1:-tests,bench}
has() { [[ $MODE == all || ",$MODE," == *",$1,"* ]]; }
if has tests; then
  step tp_tests 300 .gpu/gpu_tp --test-threads=1
fi
if has bench; then
  # Each call waits for its exchange (the default), then with deferred failures (returns once enqueued).
  step tp_bench 100 .gpu/tp_linear_logp --cuda "$GPUS" 4096 2048 131072 9
  step tp_bench_deferred 100 .gpu/tp_linear_logp --cuda "$GPUS" 4096 2048 131072 9 --deferred
  step tp_bench_procs_deferred 100 .gpu/tp_linear_logp --cuda-procs "$GPUS" 4096 2048 131072 9 --deferred
  step tp_bench_262k_deferred 100 .gpu/tp_linear_logp --cuda "$GPUS" 4096 2048 262144 9 --deferred
  # The RL head: temperature 0.7 with the entropy (and its gradient).
  step tp_bench_rl_deferred 100 .gpu/tp_linear_logp --cuda "$GPUS" 4096 2048 131072 9 --deferred --temperature 0.7 --entropy
  step tp_bench_rl_262k_deferred 100 .gpu/tp_linear_logp --cuda "$GPUS" 4096 2048 262144 9 --deferred --temperature 0.7 --entropy
  # The floor: cuBLAS at each world's per-rank shape, one GPU.
  step cublas_shard 120 python3 benches/cublas_reference.py tp 4096 2048 131072 262144; grep -h "^CUBLAS_TP" "$OUT/cublas_shard.log"
fi
if has large; then
  step large_batch 200 .gpu/gpu cuda_large_batch fusion_sm90 --include-ignored --test-threads=1
fi
