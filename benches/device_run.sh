#!/usr/bin/env bash
# One H100 run: the CUDA test suites (registry default = Sm90 for bf16/f16, then forced CubeCl),
# compute-sanitizer on the raw kernels, the GPU report beside cuBLAS, and the main example.
# Expects the stripped binaries (xz) in .gpu/ (see README "GPU runs"); writes logs to $OUT.
# `overhead`: the public-call overhead bench (`benches/call_overhead.rs`) and cuBLAS at the same shapes.
# `kernels`: the kernel crate's CUDA tests (.gpu/{kgemm,klogp}); `ksanitize`: compute-sanitizer on klogp.
# `memory`: device memory around one forward + backward (gpu_report memory).
# `sample`: linear_sample (gpu_report sample) beside cuBLAS and PyTorch's sampling (benches/sample_reference.py);
# `samplesanitize`: compute-sanitizer on the sampler's tests (Sm90 for bf16, CubeCl for f32).
# `rl`: the RL head (temperature, entropy) beside the plain call (gpu_report rl), cuBLAS beside;
# `rlsanitize`: compute-sanitizer on the RL head's tests (Sm90 for f16/bf16, CubeCl for f32).
# `limits`: sizes past the kernels' launch and addressing limits (.gpu/limits), default and CubeCl,
# and the tensor-parallel suite on one GPU (.gpu/gpu_tp).
# `vulkan`: the wgpu suites and the wgpu report through Vulkan/SPIR-V (.gpu/{gpu_vk,gpu_report_vk},
# built with `--features vulkan,cuda`; the loaders from .gl/, see the device README), cuBLAS f16 beside.
# `attn`: attention and RMSNorm (.gpu/attention_report; long-context decode included) beside PyTorch SDPA
# (benches/sdpa_reference.py) and Burn's attention, table in $OUT/attention_table.md; its parts, one device call each where time is short:
# `attnours` (ours: prefill, decode, RMSNorm), `attnref` (SDPA, Burn), `attnmore` (memory; decode and RMSNorm
# with BURN_INVARIANT_IMPL=cubecl); `attnsanitize`: compute-sanitizer on the attention and rms_norm tests of
# cuda::raw; `model`: the transformer example (.gpu/transformer_rollout), default and CubeCl. `sm90attn`, `sm90sanitize`:
# the raw SM90 attention through kernels/tools/sm90_harness.py (no Rust binary), and compute-sanitizer on it.
# `katt`: the kernel crate's attention tests alone.
# `attncubecl`: the CubeCl attention (BURN_INVARIANT_IMPL=cubecl): the kernel crate's attention tests (.gpu/katt),
# prefill (Dh 128 and 64) and decode beside SDPA, and ncu's per-kernel times of the prefill.
# `wholemodel`: the whole-model timing (.gpu/whole_model, benches/whole_model.rs): ours (registry default, then
# BURN_INVARIANT_IMPL=cubecl), Burn's own ops, the f32 check (NdArray) and PyTorch (benches/whole_model.py, which also
# compares its f32 log-probs with the check's); table in $OUT/whole_model.md; its parts `wmours` (check, ours twice)
# and `wmref` (Burn's ops, PyTorch), one device call each. Sizes from WM_* (default: 4 layers of
# d_model 4096, 32/8 heads, d_ff 14336, V 128256; decode 64 x 2048, train 8 x 2048).
set -uo pipefail
(cd .gpu && for f in *.xz; do [[ -e $f ]] && xz -d -f "$f"; done; for b in gpu gpu_report lm_head call_overhead kgemm klogp katt gpu_vk gpu_report_vk limits gpu_tp attention_report transformer_rollout whole_model; do [[ -e $b ]] && chmod +x "$b"; done)
export BURN_INVARIANT_REQUIRE_CUDA=1 CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/device.txt"; date -u >> "$OUT/device.txt"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; (time timeout "$limit" "$@") > "$OUT/$name.log" 2>&1; echo "rc=$?"; grep -E "^test .*FAILED|test result|ERROR SUMMARY|RACECHECK SUMMARY|^RESULT|^CHECK|panicked" "$OUT/$name.log" | head -60; }
MODE=${1:-all}  # all, or a comma-separated list of: tests, katt, attncubecl, limits, sanitize, bench, overhead, example, kernels, ksanitize, memory, vulkan, rl, rlsanitize, attn, attnours, attnref, attnmore, attnsanitize, model, wholemodel, wmours, wmref, sm90attn, sm90sanitize, sample, samplesanitize
has() { [[ $MODE == all || ",$MODE," == *",$1,"* ]]; }
if has tests; then
  step tests_default 300 .gpu/gpu cuda --test-threads=1
  BURN_INVARIANT_IMPL=cubecl step tests_cubecl 300 .gpu/gpu cuda --test-threads=1
fi
if has limits; then
  step limits_default 300 .gpu/limits cuda --test-threads=1
  BURN_INVARIANT_IMPL=cubecl step limits_cubecl 300 .gpu/limits cuda --test-threads=1
  step gpu_tp_one 200 .gpu/gpu_tp --test-threads=1
fi
if has sanitize; then
  step memcheck 150 compute-sanitizer --tool memcheck .gpu/gpu cuda::raw::matmul_correctness_fixed_shapes cuda::raw::linear_logp_gradients_vs_f64 --test-threads=1
  step racecheck 150 compute-sanitizer --tool racecheck .gpu/gpu cuda::raw::linear_logp_correctness_fixed_shapes --test-threads=1
fi
if has kernels; then
  step kgemm 200 .gpu/kgemm gemm_cuda --test-threads=1
  step klogp 200 .gpu/klogp logp_cuda --test-threads=1
fi
if has ksanitize; then
  step memcheck_klogp 240 compute-sanitizer --tool memcheck .gpu/klogp logp_cuda --test-threads=1
  step racecheck_klogp 240 compute-sanitizer --tool racecheck .gpu/klogp logp_cuda --test-threads=1
fi
if has bench; then
  step report 300 .gpu/gpu_report
  step cublas 120 python3 benches/cublas_reference.py
  python3 benches/compare.py "$OUT/report.log" "$OUT/cublas.log" > "$OUT/table.md"; cat "$OUT/table.md"
fi
if has rl; then
  step report_rl 480 .gpu/gpu_report rl
  step cublas 120 python3 benches/cublas_reference.py
  python3 benches/compare.py "$OUT/report_rl.log" "$OUT/cublas.log" > "$OUT/table_rl.md"; cat "$OUT/table_rl.md"
  python3 benches/rl_head_ratios.py "$OUT/report_rl.log" > "$OUT/rl_ratios.md"; cat "$OUT/rl_ratios.md"
fi
if has rlsanitize; then
  step memcheck_rl 240 compute-sanitizer --tool memcheck .gpu/gpu cuda::raw::linear_logp_rl_head_gradients_vs_f64 cuda::raw::linear_logp_rl_head_correctness --test-threads=1
  step racecheck_rl 240 compute-sanitizer --tool racecheck .gpu/gpu cuda::raw::linear_logp_rl_head_correctness --test-threads=1
fi
if has sample; then
  step report_sample 540 .gpu/gpu_report sample
  step torch_sample 240 bash -c "cd benches && python3 sample_reference.py"
  grep -h "^RESULT" "$OUT/report_sample.log" "$OUT/torch_sample.log"
fi
if has samplesanitize; then
  step memcheck_sample 300 compute-sanitizer --tool memcheck .gpu/gpu cuda::raw::linear_sample_scores cuda::raw::linear_sample_row_invariance --test-threads=1
  step racecheck_sample 300 compute-sanitizer --tool racecheck .gpu/gpu cuda::raw::linear_sample_scores --test-threads=1
fi
if has memory; then
  step memory 200 .gpu/gpu_report memory; grep -h "^MEMORY" "$OUT/memory.log"
fi
if has vulkan; then
  if ! ldconfig -p | grep -q libvulkan; then for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig; fi
  [[ -e /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  BURN_INVARIANT_REQUIRE_WGPU=1 step tests_vulkan 300 .gpu/gpu_vk wgpu:: --test-threads=1
  step report_vulkan 300 .gpu/gpu_report_vk wgpu
  step cublas_f16 120 python3 benches/cublas_reference.py f16
  python3 benches/compare.py "$OUT/report_vulkan.log" "$OUT/cublas_f16.log" > "$OUT/table_vulkan.md"; cat "$OUT/table_vulkan.md"
  grep -h "^WGPU" "$OUT/report_vulkan.log"
fi
if has overhead; then
  step overhead 200 .gpu/call_overhead
  step cublas_decode 60 python3 benches/cublas_decode.py; cat "$OUT/cublas_decode.log"
  grep -h "^OVERHEAD_DELTA" "$OUT/overhead.log"
fi
# attn = attnours + attnref + attnmore (worst case 805 s of step limits: past one call, so run the parts); each
# part rebuilds the table from the logs present in $OUT.
attn_table() {
  local logs=(); for f in attn_prefill attn_decode attn_long attn_rms attn_burn attn_memory attn_decode_cubecl attn_rms_cubecl sdpa sdpa_long; do [[ -s $OUT/$f.log ]] && logs+=("$OUT/$f.log"); done
  python3 benches/attention_compare.py ${logs[@]+"${logs[@]}"} > "$OUT/attention_table.md"
}
if has attn || has attnours; then
  step attn_prefill 180 .gpu/attention_report prefill
  step attn_decode 45 .gpu/attention_report decode
  step attn_long 120 .gpu/attention_report long
  step attn_rms 30 .gpu/attention_report rms
  attn_table
fi
if has attn || has attnref; then
  step sdpa 100 python3 benches/sdpa_reference.py; grep -h "^NOTICE\|^SKIP" "$OUT/sdpa.log"
  step sdpa_long 120 python3 benches/sdpa_reference.py long
  step attn_burn 100 .gpu/attention_report burn; grep -h "^SKIP" "$OUT/attn_burn.log"
  attn_table
fi
if has katt || has attncubecl; then
  step katt 300 .gpu/katt attention_cuda attention_tc_cuda --test-threads=1
fi
if has attncubecl; then
  BURN_INVARIANT_IMPL=cubecl step attn_prefill_cubecl 180 .gpu/attention_report prefill
  BURN_INVARIANT_IMPL=cubecl step attn_decode_cubecl 45 .gpu/attention_report decode
  step sdpa 120 python3 benches/sdpa_reference.py prefill,decode
  ATTN_PREFILL_HEAD_DIM=64 BURN_INVARIANT_IMPL=cubecl step attn_prefill64_cubecl 180 .gpu/attention_report prefill
  ATTN_PREFILL_HEAD_DIM=64 step sdpa64 100 python3 benches/sdpa_reference.py prefill
  grep -h "^RESULT" "$OUT"/attn_prefill_cubecl.log "$OUT"/attn_decode_cubecl.log "$OUT"/sdpa.log "$OUT"/attn_prefill64_cubecl.log "$OUT"/sdpa64.log
  BURN_INVARIANT_IMPL=cubecl step ncu_attn 150 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:attention -c 70 .gpu/attention_report prefill
fi
if has attn || has attnmore; then
  step attn_memory 60 .gpu/attention_report memory; grep -h "^MEMORY\|^SKIP" "$OUT/attn_memory.log"
  BURN_INVARIANT_IMPL=cubecl step attn_decode_cubecl 30 .gpu/attention_report decode
  BURN_INVARIANT_IMPL=cubecl step attn_rms_cubecl 20 .gpu/attention_report rms
  attn_table
fi
if has attn || has attnours || has attnref || has attnmore; then cat "$OUT/attention_table.md"; fi
if has attnsanitize; then
  ATTN_TESTS="cuda::raw::attention_values_vs_f64 cuda::raw::attention_gradients_vs_f64 cuda::raw::attention_decode_equals_prefill cuda::raw::rms_norm_values_and_row_invariance cuda::raw::rms_norm_gradients_and_padding"
  step memcheck_attn 200 compute-sanitizer --tool memcheck .gpu/gpu $ATTN_TESTS --test-threads=1
  step racecheck_attn 200 compute-sanitizer --tool racecheck .gpu/gpu $ATTN_TESTS --test-threads=1
fi
if has model; then
  step model_default 200 .gpu/transformer_rollout; tail -8 "$OUT/model_default.log"
  BURN_INVARIANT_IMPL=cubecl step model_cubecl 200 .gpu/transformer_rollout; tail -8 "$OUT/model_cubecl.log"
fi
# wholemodel = wmours + wmref (worst case 780 s of step limits, typically a few minutes); each part rebuilds the table.
wm_table() {
  local logs=(); for f in wm_check wm_ours wm_ours_cubecl wm_burn wm_torch; do [[ -s $OUT/$f.log ]] && logs+=("$OUT/$f.log"); done
  python3 benches/whole_model.py --table ${logs[@]+"${logs[@]}"} > "$OUT/whole_model.md"
}
if has wholemodel || has wmours; then
  step wm_check 60 .gpu/whole_model check
  step wm_ours 180 .gpu/whole_model ours
  BURN_INVARIANT_IMPL=cubecl step wm_ours_cubecl 180 .gpu/whole_model ours
  wm_table
fi
if has wholemodel || has wmref; then
  [[ -s $OUT/wm_check.log ]] || step wm_check 60 .gpu/whole_model check
  step wm_burn 180 .gpu/whole_model burn
  step wm_torch 180 python3 benches/whole_model.py "$OUT/wm_check.log"
  wm_table
fi
if has wholemodel || has wmours || has wmref; then cat "$OUT/whole_model.md"; fi
# `sm90attn`: the raw SM90 attention (kernels/attention_sm90.cu) through its harness: forward (the wide Dh 64 variant
# included), splits and backward against f64 and every invariance, then timings beside SDPA. Needs no Rust binary.
if has sm90attn; then
  step sm90_attn 240 python3 kernels/tools/sm90_harness.py --only attn,attnsplit,attnbwd
  step sm90_attnperf 240 python3 kernels/tools/sm90_harness.py --only attnperf,attnlong
  grep -h "FAIL\|SUMMARY" "$OUT/sm90_attn.log" | tail -20; grep -h "^| \|wide" "$OUT/sm90_attnperf.log" | tail -24
fi
# `sm90sanitize`: compute-sanitizer (memcheck, racecheck, synccheck) on the harness's sanitize workload (every raw
# entry point).
if has sm90sanitize; then
  step sm90_memcheck 240 compute-sanitizer --tool memcheck python3 kernels/tools/sm90_harness.py --only sanitize
  step sm90_racecheck 240 compute-sanitizer --tool racecheck python3 kernels/tools/sm90_harness.py --only sanitize
  step sm90_synccheck 240 compute-sanitizer --tool synccheck python3 kernels/tools/sm90_harness.py --only sanitize
fi
if has example; then
  step example 120 .gpu/lm_head; tail -6 "$OUT/example.log"
fi
