#!/usr/bin/env python3
"""cuBLAS (through PyTorch) side of the GPU report: the same shapes as benches/gpu_report.rs, printed as
RESULT lines with impl=cuBLAS. Timing: CUDA events, 200 ms of warm-up, median of repetitions of a batch of calls,
random data, TF32 off. For linear_logp the reference is one [N,D]x[D,V] GEMM (four for forward+backward),
with V rounded up to a multiple of 128 (cuBLAS takes a slow path at V=50257).
`cublas_reference.py f16`: the M=4096 matmul and linear_logp shapes in f16 (the wgpu/Vulkan report's dtype);
`cublas_reference.py tp N D V..`: the tensor-parallel bench's per-rank shapes (`tp_shards`)."""
import sys
import time

import torch

torch.backends.cuda.matmul.allow_tf32 = False
PROJECTIONS = [(4096, 12288), (4096, 4096), (4096, 14336), (14336, 4096), (4096, 32000)]


def median_ms(fn, batch, reps=7):
    # At least 200 ms of warm-up calls, so the GPU clocks have left their idle state.
    start = time.perf_counter()
    while time.perf_counter() - start < 0.2:
        fn()
        torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / batch)
    return sorted(out)[reps // 2]


def report(op, shape, ms, flops):
    print(f"RESULT op={op} impl=cuBLAS {shape} ms={ms:.4f} tflops={flops / (ms * 1e-3) / 1e12:.1f}", flush=True)


def tp_shards(n, d, vocabs):
    """`cublas_reference.py tp N D V [V ..]`: the per-rank shape of the tensor-parallel bench
    (examples/tp_linear_logp.rs), bf16: N rows of D against a vocabulary shard of V / world columns for
    worlds 1, 2, 4; one forward GEMM and the four of a forward + backward (logits, the backward's recomputed
    logits, dHidden = dZ . W, dWeight = dZ^T . H), the floor a rank's leaves cannot beat."""
    for v in vocabs:
        base = None
        for world in (1, 2, 4):
            vs = -(-v // world)
            h = (torch.randn(n, d, device="cuda") * 0.1).to(torch.bfloat16)
            w = (torch.randn(vs, d, device="cuda") * 0.05).to(torch.bfloat16)
            dz = (torch.randn(n, vs, device="cuda") * 1e-3).to(torch.bfloat16)
            fwd = median_ms(lambda: h @ w.t(), 5)
            four = 2 * fwd + median_ms(lambda: dz @ w, 5) + median_ms(lambda: dz.t() @ h, 5)
            base = base or four
            print(f"CUBLAS_TP V={v} world={world} shard={vs} fwd_ms={fwd:.4f} fwd_bwd4_ms={four:.4f} "
                  f"ratio_vs_world1={four / base:.3f}", flush=True)


if sys.argv[1:2] == ["tp"]:
    args = [int(a) for a in sys.argv[2:]] or [4096, 2048, 131072, 262144]
    tp_shards(args[0], args[1], args[2:])
    sys.exit(0)

DT, NAME = (torch.float16, "f16") if sys.argv[1:] == ["f16"] else (torch.bfloat16, "bf16")
for k, n in PROJECTIONS:
    rhs = (torch.rand(k, n, device="cuda") * 0.1 - 0.05).to(DT)
    for m in (4096, 64, 16, 1) if NAME == "bf16" else (4096,):
        lhs = (torch.rand(m, k, device="cuda") * 2 - 1).to(DT)
        flops = 2.0 * m * k * n
        shape = f"dtype={NAME} m={m} k={k} n={n}"
        report("matmul", shape, median_ms(lambda: lhs @ rhs, 10 if m == 4096 else 50), flops)
        if m == 4096:
            g = (torch.rand(m, n, device="cuda") * 2 - 1).to(DT)
            report("matmul_backward", shape, median_ms(lambda: (g @ rhs.t(), lhs.t() @ g), 5), 2 * flops)

n, d = 4096, 2048
for v in (32768, 50257, 131072):
    vp = (v + 127) // 128 * 128
    h = (torch.rand(n, d, device="cuda") * 2 - 1).to(DT)
    w = (torch.rand(vp, d, device="cuda") * 0.1 - 0.05).to(DT)
    flops = 2.0 * n * d * v
    shape = f"dtype={NAME} n={n} d={d} v={v}"
    one = median_ms(lambda: h @ w.t(), 5)
    report("linear_logp_fwd", shape, one, flops)
    report("linear_logp_fwd_bwd", shape, 4 * one, 4 * flops)
