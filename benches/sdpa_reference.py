#!/usr/bin/env python3
"""PyTorch side of the attention report (benches/attention_report.rs): the same shapes, bf16, printed as RESULT
lines that benches/attention_compare.py joins with the Rust log.

- `impl=SDPA`: torch.nn.functional.scaled_dot_product_attention with the default backend choice; `sdpa_backend=`
  names the kernel that ran (read from the profiler's aten op names), `gqa=native` where `enable_gqa=True`
  reached a fused kernel, `gqa=repeated` where K/V were expanded to the query heads beforehand (outside the
  timing) because it did not (or `enable_gqa` is missing). `impl=SDPA_<backend>`: each fused backend forced
  (flash, cudnn, efficient) where it takes the case.
- Prefill: causal (Q = KV, so torch's top-left `is_causal` is the usual mask). Decode (Q = 1): `is_causal=False`
  (torch aligns the causal mask top-left, which would leave one key); ragged rows through a bool `attn_mask`
  [B, 1, 1, KV] (True = attend) with lengths 1 + b*(KV-1)/(B-1).
- Forward + backward: torch.autograd.grad of out.sum() for (q, k, v) (no .grad accumulation).
- RMSNorm: `impl=TorchOps` (f32 mean of squares, rsqrt, cast back, times gamma: the LLaMA reference code) and
  `impl=TorchRmsNorm` (torch.nn.functional.rms_norm where present), GB/s of the ideal bytes as in the Rust report.

Timing: the first call decides (over 10 s: a SKIP line), then at least 200 ms of warm-up, then the median over
3-7 repetitions of a batch of calls timed with CUDA events. `sdpa_reference.py [prefill|decode|long|rms[,...]]`;
`ATTN_PREFILL_HEAD_DIM` sets the prefill head size (default 128), as for the Rust report."""
import os
import sys
import time

import torch
import torch.nn.functional as F

PREFILL = (8, 32, 8, int(os.environ.get("ATTN_PREFILL_HEAD_DIM", "128")))  # B, H, KH, Dh
PREFILL_SEQS = (2048, 4096)
DECODE = (64, 32, 8, 4096, 128)  # B, H, KH, KV, Dh
RMS = (16384, 4096)
RMS_EPS = 1e-6
PEAK_GBPS = 3350.0
MAX_CALL_S = 10.0
REP_BUDGET_S = 4.0
DT = torch.bfloat16

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    BACKENDS = [(name, getattr(SDPBackend, attr)) for name, attr in
                (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"))
                if hasattr(SDPBackend, attr)]
except ImportError:  # torch < 2.3: no per-backend forcing
    BACKENDS, sdpa_kernel = [], None


def sync():
    torch.cuda.synchronize()


def median_ms(name, fn):
    """Median milliseconds per call of fn, or None (a SKIP line printed) where the first call takes over
    MAX_CALL_S or fails."""
    try:
        start = time.perf_counter()
        fn()
        sync()
        first = time.perf_counter() - start
        if first > MAX_CALL_S:
            print(f"SKIP {name}: the first call took {first:.1f} s (> {MAX_CALL_S} s)", flush=True)
            return None
        calls, warm = 0, time.perf_counter()
        while calls == 0 or time.perf_counter() - warm < 0.2:
            fn()
            sync()
            calls += 1
        per_call = (time.perf_counter() - warm) / calls
        batch = min(max(int(0.05 / per_call), 1), 50)
        reps = min(max(int(REP_BUDGET_S / (per_call * batch)), 3), 7)
        out = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(batch):
                fn()
            b.record()
            sync()
            out.append(a.elapsed_time(b) / batch)
        return sorted(out)[reps // 2]
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # no kernel for the case, out of memory
        sync()
        print(f"SKIP {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
        return None


def report(op, imp, shape, ms, flops=0.0, nbytes=0.0, extra=""):
    if ms is None:
        return
    line = f"RESULT op={op} impl={imp} {shape} ms={ms:.4f}"
    if flops:
        line += f" tflops={flops / (ms * 1e-3) / 1e12:.1f}"
    if nbytes:
        gbps = nbytes / (ms * 1e-3) / 1e9
        line += f" gbps={gbps:.0f} peak_frac={gbps / PEAK_GBPS:.3f}"
    if extra:
        line += " " + extra
    print(line, flush=True)


def rand(*shape, grad=False):
    return (torch.rand(*shape, device="cuda") * 2 - 1).to(DT).requires_grad_(grad)


def backend_of(fn):
    """The SDPA kernel fn dispatches to, from the aten op names the profiler records."""
    names = {
        "_scaled_dot_product_flash_attention": "flash",
        "_scaled_dot_product_cudnn_attention": "cudnn",
        "_scaled_dot_product_efficient_attention": "efficient",
        "_scaled_dot_product_attention_math": "math",
        "_scaled_dot_product_fused_attention_overrideable": "overrideable",
    }
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
            sync()
        seen = {e.key for e in prof.key_averages()}
    except Exception as e:  # profiler unavailable
        return f"unknown({type(e).__name__})"
    for op, name in names.items():
        if f"aten::{op}" in seen:
            return name
    return "unknown"


def has_enable_gqa():
    q, k = rand(1, 2, 4, 64), rand(1, 1, 4, 64)
    try:
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        return True
    except TypeError:
        return False


GQA = has_enable_gqa()


def sdpa_cases(op, shape, q, k, v, group, causal, mask, backward, flops, nbytes):
    """Times SDPA on (q, k, v) with the default dispatch (impl=SDPA) and each fused backend forced."""
    k_rep, v_rep = k.detach().repeat_interleave(group, 1), v.detach().repeat_interleave(group, 1)
    if backward:
        k_rep.requires_grad_(True)
        v_rep.requires_grad_(True)

    def call(native):
        kk, vv = (k, v) if native else (k_rep, v_rep)
        extra = {"enable_gqa": True} if native else {}

        def fn():
            out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=causal, **extra)
            if backward:
                torch.autograd.grad(out.sum(), (q, kk, vv))
        return fn

    # Default dispatch: native GQA where it reaches a fused kernel, else K/V repeated.
    native = GQA
    backend = backend_of(call(True)) if GQA else "n/a"
    if not GQA or backend == "math":
        native = False
        backend = backend_of(call(False))
    gqa = "native" if native else "repeated"
    report(op, "SDPA", shape, median_ms(f"op={op} impl=SDPA {shape}", call(native)), flops, nbytes,
           f"sdpa_backend={backend} gqa={gqa}")
    for name, b in BACKENDS:
        for native in ([True, False] if GQA else [False]):
            label = f"op={op} impl=SDPA_{name} gqa={'native' if native else 'repeated'} {shape}"
            try:
                with sdpa_kernel([b]):
                    call(native)()
                    sync()
            except RuntimeError:
                continue  # this backend does not take the case this way
            with sdpa_kernel([b]):
                ms = median_ms(label, call(native))
            report(op, f"SDPA_{name}", shape, ms, flops, nbytes, f"gqa={'native' if native else 'repeated'}")
            break


def prefill():
    b, h, kh, d = PREFILL
    for s in PREFILL_SEQS:
        shape = f"dtype=bf16 b={b} h={h} kh={kh} q={s} kv={s} d={d}"
        flops = 4.0 * b * h * (s * (s + 1) // 2) * d
        for backward in (False, True):
            q, k, v = rand(b, h, s, d, grad=backward), rand(b, kh, s, d, grad=backward), rand(b, kh, s, d, grad=backward)
            op = "attn_prefill_fwd_bwd" if backward else "attn_prefill_fwd"
            sdpa_cases(op, shape, q, k, v, h // kh, True, None, backward, flops * (3.5 if backward else 1.0), 0.0)
            del q, k, v
            torch.cuda.empty_cache()


def decode():
    b, h, kh, kv, d = DECODE
    q, k, v = rand(b, h, 1, d), rand(b, kh, kv, d), rand(b, kh, kv, d)
    for ragged in (False, True):
        lens = [1 + i * (kv - 1) // max(b - 1, 1) for i in range(b)] if ragged else [kv] * b
        visible = sum(lens)
        flops = 4.0 * h * visible * d
        nbytes = 2.0 * kh * visible * d * 2 + 2.0 * b * h * d * 2
        mask = None
        if ragged:
            mask = (torch.arange(kv, device="cuda")[None, :] < torch.tensor(lens, device="cuda")[:, None])
            mask = mask[:, None, None, :]
        op = "attn_decode_ragged" if ragged else "attn_decode_full"
        shape = f"dtype=bf16 b={b} h={h} kh={kh} q=1 kv={kv} d={d} lens={'ragged' if ragged else 'full'}"
        sdpa_cases(op, shape, q, k, v, h // kh, False, mask, False, flops, nbytes)


def long_decode():
    """attention_report's attn_decode_long: B 1 and 8, one query over 32768 or 131072 keys, all valid."""
    _, h, kh, _, d = DECODE
    for b in (1, 8):
        for kv in (32768, 131072):
            q, k, v = rand(b, h, 1, d), rand(b, kh, kv, d), rand(b, kh, kv, d)
            shape = f"dtype=bf16 b={b} h={h} kh={kh} q=1 kv={kv} d={d}"
            nbytes = 2.0 * b * kh * kv * d * 2 + 2.0 * b * h * d * 2
            sdpa_cases("attn_decode_long", shape, q, k, v, h // kh, False, None, False, 4.0 * b * h * kv * d, nbytes)
            del q, k, v
            torch.cuda.empty_cache()


def rms():
    n, d = RMS
    shape = f"dtype=bf16 n={n} d={d}"
    fwd_bytes = (2 * n * d + d) * 2
    bwd_bytes = (3 * n * d + 2 * d) * 2

    def torch_ops(x, g):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return h.to(x.dtype) * g

    impls = [("TorchOps", torch_ops)]
    if hasattr(F, "rms_norm"):
        impls.append(("TorchRmsNorm", lambda x, g: F.rms_norm(x, (d,), g, RMS_EPS)))
    x, g = rand(n, d), rand(d)
    xg, gg = rand(n, d, grad=True), rand(d, grad=True)
    for name, f in impls:
        report("rms_norm_fwd", name, shape, median_ms(f"op=rms_norm_fwd impl={name}", lambda: f(x, g)),
               nbytes=fwd_bytes)

        def fwd_bwd():
            torch.autograd.grad(f(xg, gg).sum(), (xg, gg))
        report("rms_norm_fwd_bwd", name, shape, median_ms(f"op=rms_norm_fwd_bwd impl={name}", fwd_bwd),
               nbytes=fwd_bytes + bwd_bytes)


if __name__ == "__main__":
    what = sys.argv[1].split(",") if len(sys.argv) > 1 else ["prefill", "decode", "rms"]
    if not torch.cuda.is_available():
        print("NOTICE: no CUDA device; the SDPA reference needs an NVIDIA GPU")
        sys.exit(0)
    print(f"NOTICE torch={torch.__version__} cuda={torch.version.cuda} cudnn={torch.backends.cudnn.version()} "
          f"device={torch.cuda.get_device_name(0).replace(' ', '_')} enable_gqa={GQA} "
          f"backends={','.join(n for n, _ in BACKENDS) or 'default-only'}", flush=True)
    if "prefill" in what:
        prefill()
    if "decode" in what:
        decode()
    if "long" in what:
        long_decode()
    if "rms" in what:
        rms()
