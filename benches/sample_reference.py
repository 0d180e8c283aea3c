#!/usr/bin/env python3
"""The PyTorch side of `gpu_report sample`: at the same shapes (bf16, N = 64 and 4096, D = 4096, V = 128256,
the same flat / peaked logit scales), one cuBLAS GEMM [N, D] x [D, V] (the floor of any sampler that computes
the logits), and the usual ways to sample from them: GEMM + softmax + multinomial, GEMM + Gumbel-max
(argmax of logits + noise), GEMM + argmax (greedy), GEMM + top-k(50) + softmax + multinomial. RESULT lines as
benches/cublas_reference.py prints them (CUDA events, warm-up, medians)."""
import torch

from cublas_reference import median_ms

torch.backends.cuda.matmul.allow_tf32 = False


def main():
    d, v = 4096, 128256
    w = ((torch.rand(v, d, device="cuda") * 2 - 1) * 0.05).to(torch.bfloat16)
    for n in (64, 4096):
        flops = 2.0 * n * d * v
        batch = 10 if n == 64 else 2
        for regime, scale in (("flat", 1.0), ("peaked", 10.0)):
            h = ((torch.rand(n, d, device="cuda") * 2 - 1) * scale).to(torch.bfloat16)

            def gemm():
                return h @ w.t()

            def multinomial():
                p = torch.softmax(gemm().float(), dim=-1)
                return torch.multinomial(p, 1)

            def gumbel():
                z = gemm().float()
                g = -torch.log(-torch.log(torch.rand_like(z).clamp_(1e-20, 1.0)))
                return torch.argmax(z + g, dim=-1)

            def greedy():
                return torch.argmax(gemm(), dim=-1)

            def top50():
                vals, idx = torch.topk(gemm().float(), 50, dim=-1)
                return idx.gather(-1, torch.multinomial(torch.softmax(vals, dim=-1), 1))

            for name, fn in (("cuBLAS", gemm), ("torch+multinomial", multinomial), ("torch+gumbel", gumbel),
                             ("torch+greedy", greedy), ("torch+top50", top50)):
                ms = median_ms(fn, batch)
                impl = name if name == "cuBLAS" else f"{name}+{regime}"
                if name == "cuBLAS":
                    impl = f"cuBLAS+{regime}"
                print(f"RESULT op=linear_sample impl={impl} dtype=bf16 n={n} d={d} v={v} ms={ms:.4f} "
                      f"tflops={flops / (ms * 1e-3) / 1e12:.1f}", flush=True)


if __name__ == "__main__":
    main()
