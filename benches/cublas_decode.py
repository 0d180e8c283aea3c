"""cuBLAS (torch.mm, bf16) at the decode shapes of benches/call_overhead.rs, timed the same way:
>= 200 ms of warm-up, then the median over 15 samples of 200 queued calls and one synchronize."""
import time

import torch

BATCH, REPS = 200, 15


def per_call(f):
    start = time.perf_counter()
    while time.perf_counter() - start < 0.2:
        for _ in range(BATCH):
            f()
        torch.cuda.synchronize()
    samples = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        for _ in range(BATCH):
            f()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / BATCH)
    return sorted(samples)[REPS // 2]


for m in (1, 16, 64):
    k = n = 4096
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.02
    s = per_call(lambda: torch.mm(a, b))
    print(f"CUBLAS m={m} k={k} n={n} us_per_call={s * 1e6:.2f}")
