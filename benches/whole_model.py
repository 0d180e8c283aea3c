#!/usr/bin/env python3
"""The whole-model bench's PyTorch side: the Llama-style policy of
`examples/transformer_rollout/model.rs` (`Policy::hashed` weights, bit for bit before the bf16
rounding) in eager PyTorch: cuBLAS matmuls, `F.scaled_dot_product_attention` (GQA), RMSNorm and the
half-split RoPE in f32, SwiGLU, logits materialized + f32 `log_softmax` + gather.

`python3 benches/whole_model.py [CHECK_LOG]` (`--table LOG..`: the markdown table of the logs'
`RESULT whole_model` lines, ratios to torch):
- with CHECK_LOG (the output of `whole_model check`): the tiny config in f32 on the CPU, its
  per-token log-probs against the Rust `CHECK logp i value` lines (ours on the NdArray Reference
  backend), `CHECK torch_vs_ours max_abs_diff=.. ok=..` (tolerance `WM_CHECK_TOL`, 1e-4);
- then (unless `WM_SKIP_BENCH=1`, or no CUDA) the timing in bf16 on CUDA, sizes and repetitions
  from the same `WM_*` variables as `benches/whole_model.rs`: one decode step (batch 64 over 2048
  cached tokens, the cache preallocated and written in place) and one training step (forward +
  backward, 8 x 2048 tokens), median of `WM_REPS` after `WM_WARMUP`, CUDA events;
  `RESULT whole_model torch impl=torch rollout_ms=.. train_ms=.. rollout_mean_logp=.. train_loss=..`.
"""
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

M64 = (1 << 64) - 1
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
GOLDEN, ID_MUL = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03
TRAIN_TOKENS, PREFILL_TOKENS, DECODE_TOKENS, DECODE_TARGETS = 1000, 1001, 1002, 1003
ROPE_THETA, RMS_EPS = 10000.0, 1e-5
CHUNK = 1 << 25  # elements hashed per kernel batch (int64 temporaries of 256 MiB)


def env(name, default):
    return int(os.environ.get(name, default))


def sizes_from_env():
    return dict(
        layers=env("WM_LAYERS", 4), d_model=env("WM_D_MODEL", 4096), heads=env("WM_HEADS", 32),
        kv_heads=env("WM_KV_HEADS", 8), head_dim=env("WM_HEAD_DIM", 128), d_ff=env("WM_D_FF", 14336),
        vocab=env("WM_VOCAB", 128256), decode_batch=env("WM_DECODE_BATCH", 64),
        context=env("WM_CONTEXT", 2048), train_batch=env("WM_TRAIN_BATCH", 8),
        train_len=env("WM_TRAIN_LEN", 2048), warmup=env("WM_WARMUP", 2),
        reps=max(env("WM_REPS", 7), 1), seed=env("WM_SEED", 7))


# `Sizes::check()` of whole_model.rs.
CHECK_SIZES = dict(layers=2, d_model=64, heads=4, kv_heads=2, head_dim=16, d_ff=128, vocab=300,
                   decode_batch=2, context=16, train_batch=2, train_len=17, warmup=0, reps=1, seed=7)


def capacity(s):
    return s["context"] + s["warmup"] + s["reps"]


# --- the weight formula (model.rs: mix64, hash_at, hashed_uniform, hashed_tokens) ---------------
def mix_int(z):
    z &= M64
    z = ((z ^ (z >> 30)) * MIX1) & M64
    z = ((z ^ (z >> 27)) * MIX2) & M64
    return z ^ (z >> 31)


def hash_int(seed, tid, i):
    return mix_int(mix_int(seed + tid * ID_MUL) + (i + 1) * GOLDEN)


def signed(c):
    """A u64 constant as the int64 of the same bits (int64 tensor arithmetic wraps)."""
    c &= M64
    return c - (1 << 64) if c >= 1 << 63 else c


def srl(x, k):
    """Logical right shift of int64 bits (`>>` on int64 is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix_t(z):
    z = (z ^ srl(z, 30)) * signed(MIX1)
    z = (z ^ srl(z, 27)) * signed(MIX2)
    return z ^ srl(z, 31)


def hashes(seed, tid, start, n, device):
    i = torch.arange(start + 1, start + n + 1, dtype=torch.int64, device=device)
    return mix_t(i * signed(GOLDEN) + signed(mix_int(seed + tid * ID_MUL)))


def f32(x):
    """`x` rounded to f32, as a Python float."""
    return torch.tensor(x, dtype=torch.float32).item()


def fan(d_in):
    # f32 division and sqrt, as Rust's `(3.0 / d_in as f32).sqrt()`.
    return torch.sqrt(torch.tensor(3.0, dtype=torch.float32) / d_in).item()


def uniform(seed, tid, shape, scale, device, dtype, offset=0.0):
    """`offset + (2u - 1)·scale` in f32 (u = top 24 bits / 2^24), then rounded once to dtype."""
    n = math.prod(shape)
    out = torch.empty(n, dtype=dtype, device=device)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        u = srl(hashes(seed, tid, start, m, device), 40).to(torch.float32) / float(1 << 24)
        v = (2.0 * u - 1.0) * f32(scale)  # one f32 product, as in Rust
        if offset:
            v = offset + v
        out[start:start + m] = v.to(dtype)
    return out.view(shape)


def tokens(seed, tid, n, vocab, device):
    return srl(hashes(seed, tid, 0, n, device), 33) % vocab


def self_test():
    """The vectorized hash against the Python-int one (int64 wrap-around assumed by mix_t)."""
    got = hashes(7, 16, 0, 5, "cpu").tolist()
    want = [signed(hash_int(7, 16, i)) for i in range(5)]
    assert got == want, f"hash mismatch: {got} vs {want}"


# --- the model ------------------------------------------------------------------------------------
class Policy:
    def __init__(self, s, device, dtype, max_seq_len):
        self.s, self.dtype = s, dtype
        d, seed = s["d_model"], s["seed"]
        q_w, kv_w = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
        u = lambda tid, shape, scale, offset=0.0: uniform(seed, tid, shape, scale, device, dtype, offset)
        lin = lambda tid, d_in, d_out: u(tid, (d_in, d_out), fan(d_in))  # [d_in, d_out], x @ W
        self.layers = []
        for l in range(s["layers"]):
            i = 16 * (l + 1)
            self.layers.append(dict(
                attn_norm=u(i, (d,), 0.1, 1.0), wq=lin(i + 1, d, q_w), wk=lin(i + 2, d, kv_w),
                wv=lin(i + 3, d, kv_w), wo=lin(i + 4, q_w, d), mlp_norm=u(i + 5, (d,), 0.1, 1.0),
                gate=lin(i + 6, d, s["d_ff"]), up=lin(i + 7, d, s["d_ff"]), down=lin(i + 8, s["d_ff"], d)))
        self.embed = u(0, (s["vocab"], d), 1.0)
        self.head = u(1, (s["vocab"], d), 2.0 * fan(d))
        self.norm = u(2, (d,), 0.1, 1.0)
        half, hd = s["head_dim"] // 2, s["head_dim"]
        # InvariantAttention's tables: f64 angles, cos/sin rounded to f32.
        ang = [[p * math.pow(ROPE_THETA, -(2.0 * i) / hd) for i in range(half)] for p in range(max_seq_len)]
        self.cos = torch.tensor([[math.cos(a) for a in r] for r in ang], dtype=torch.float32, device=device)
        self.sin = torch.tensor([[math.sin(a) for a in r] for r in ang], dtype=torch.float32, device=device)

    def params(self):
        return [self.embed, self.head, self.norm] + [t for layer in self.layers for t in layer.values()]

    @staticmethod
    def rms_norm(x, g):
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return (xf * r * g.float()).to(x.dtype)

    @staticmethod
    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def attention(self, L, x, start, cache, rows):
        s = self.s
        b, n, _ = x.shape
        heads = lambda t, h: t.view(b, n, h, s["head_dim"]).transpose(1, 2)
        q, k, v = heads(x @ L["wq"], s["heads"]), heads(x @ L["wk"], s["kv_heads"]), heads(x @ L["wv"], s["kv_heads"])
        cos, sin = self.cos[start:start + n], self.sin[start:start + n]
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if cache is not None:  # written in place, then every key so far
            ck, cv = cache
            ck[rows, :, start:start + n] = k
            cv[rows, :, start:start + n] = v
            k, v = ck[rows, :, :start + n], cv[rows, :, :start + n]
        o = sdpa(q, k, v, causal=n > 1)  # several queries only where keys = queries
        return o.transpose(1, 2).reshape(b, n, -1) @ L["wo"]

    def hidden(self, toks, start=0, caches=None, rows=slice(None)):
        x = F.embedding(toks, self.embed)
        for l, L in enumerate(self.layers):
            x = x + self.attention(L, self.rms_norm(x, L["attn_norm"]), start, caches and caches[l], rows)
            h = self.rms_norm(x, L["mlp_norm"])
            x = x + (F.silu(h @ L["gate"]) * (h @ L["up"])) @ L["down"]
        return self.rms_norm(x, self.norm)

    def head_logp(self, h, targets):
        logits = (h @ self.head.T).float()
        return logits.log_softmax(-1).gather(1, targets[:, None])[:, 0]

    def train_logp(self, toks, targets):
        b, n = toks.shape
        return self.head_logp(self.hidden(toks).reshape(b * n, -1), targets)


_GQA = None


def sdpa(q, k, v, causal):
    """SDPA with GQA: `enable_gqa` where this torch has it (2.5+), else K/V repeated."""
    global _GQA
    if _GQA is not False:
        try:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            _GQA = True
            return out
        except TypeError:
            _GQA = False
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=causal)


def train_batch(s, device):
    b, n = s["train_batch"], s["train_len"]
    seq = tokens(s["seed"], TRAIN_TOKENS, b * (n + 1), s["vocab"], device).view(b, n + 1)
    return seq[:, :n].contiguous(), seq[:, 1:].reshape(-1)


# --- the f32 check ----------------------------------------------------------------------------------
def check(log_path):
    self_test()
    want = {}
    with open(log_path) as f:
        for line in f:
            p = line.split()
            if len(p) == 4 and p[:2] == ["CHECK", "logp"]:
                want[int(p[2])] = float(p[3])
    s = CHECK_SIZES
    model = Policy(s, "cpu", torch.float32, max(capacity(s), s["train_len"]))
    toks, targets = train_batch(s, "cpu")
    with torch.no_grad():
        got = model.train_logp(toks, targets).tolist()
    tol = float(os.environ.get("WM_CHECK_TOL", "1e-4"))
    if len(want) != len(got):
        print(f"CHECK torch_vs_ours FAILED: {len(want)} Rust log-probs, {len(got)} here")
        return False
    diff = max(abs(got[i] - want[i]) for i in range(len(got)))
    ok = diff <= tol
    print(f"CHECK torch_vs_ours tokens={len(got)} max_abs_diff={diff:.3e} tol={tol:g} ok={ok} "
          f"(mean logp {sum(got) / len(got):.6f})")
    return ok


# --- the timing -------------------------------------------------------------------------------------
def median_ms(s, f):
    for _ in range(s["warmup"]):
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(s["reps"]):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def rollout(model, s, dev):
    b, ctx = s["decode_batch"], s["context"]
    shape = (b, s["kv_heads"], capacity(s), s["head_dim"])
    caches = [(torch.zeros(shape, dtype=model.dtype, device=dev), torch.zeros(shape, dtype=model.dtype, device=dev))
              for _ in model.layers]
    prompt = tokens(s["seed"], PREFILL_TOKENS, b * ctx, s["vocab"], dev).view(b, ctx)
    toks = tokens(s["seed"], DECODE_TOKENS, b, s["vocab"], dev).view(b, 1)
    targets = tokens(s["seed"], DECODE_TARGETS, b, s["vocab"], dev)
    state = {"len": ctx, "logp": None}
    with torch.inference_mode():
        for r in range(0, b, 8):  # untimed prefill, 8 rows at a time
            model.hidden(prompt[r:r + 8], 0, caches, slice(r, r + 8))

        def step():
            h = model.hidden(toks, state["len"], caches)[:, -1]
            state["logp"] = model.head_logp(h, targets)
            state["len"] += 1

        ms = median_ms(s, step)
    return ms, state["logp"].mean().item()


def train(model, s, dev):
    params = model.params()
    for p in params:
        p.requires_grad_(True)
    toks, targets = train_batch(s, dev)
    state = {}

    def step():
        for p in params:
            p.grad = None
        loss = -model.train_logp(toks, targets).mean()
        loss.backward()
        state["loss"] = loss.detach()

    ms = median_ms(s, step)
    for p in params:
        p.requires_grad_(False)
        p.grad = None
    return ms, state["loss"].item()


def guarded(name, f):
    try:
        return f()
    except torch.cuda.OutOfMemoryError as e:
        print(f"SKIP whole_model torch {name}: out of memory: {str(e).splitlines()[0]}")
    torch.cuda.empty_cache()
    return None


def bench():
    s = sizes_from_env()
    dev = "cuda"
    # The weight formula assumes int64 products wrap on the GPU as on the CPU (checked there).
    assert torch.equal(hashes(7, 16, 0, 4096, dev).cpu(), hashes(7, 16, 0, 4096, "cpu")), "GPU hash differs"
    start = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start[0].record()
    model = Policy(s, dev, torch.bfloat16, max(capacity(s), s["train_len"]))
    start[1].record()
    torch.cuda.synchronize()
    n = sum(p.numel() for p in model.params())
    print(f"INFO whole_model torch {torch.__version__} {torch.cuda.get_device_name()} params={n} "
          f"init_s={start[0].elapsed_time(start[1]) / 1e3:.1f} sizes={s}")
    rolled = guarded("rollout", lambda: rollout(model, s, dev))
    torch.cuda.empty_cache()
    trained = guarded("train", lambda: train(model, s, dev))
    fmt = lambda x, i: "NA" if x is None else f"{x[i]:.3f}"
    print(f"RESULT whole_model torch impl=torch rollout_ms={fmt(rolled, 0)} train_ms={fmt(trained, 0)} "
          f"rollout_mean_logp={fmt(rolled, 1)} train_loss={fmt(trained, 1)} gqa={'enable_gqa' if _GQA else 'repeat'}")


def table(paths):
    """Markdown table of the `RESULT whole_model` lines in `paths`, with ratios to torch."""
    rows, notes = [], []
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.startswith("RESULT whole_model "):
                    p = line.split()
                    kv = dict(x.split("=", 1) for x in p[3:] if "=" in x)
                    rows.append((p[2], kv))
                elif line.startswith(("CHECK torch_vs_ours", "CHECK burn_vs_ours", "SKIP", "INFO")):
                    notes.append(line.strip())
    num = lambda kv, k: float(kv[k]) if kv.get(k, "NA") != "NA" else None
    torch_kv = next((kv for v, kv in rows if v == "torch"), {})
    ratio = lambda kv, k: ("%.2f" % (num(kv, k) / num(torch_kv, k))
                           if num(kv, k) is not None and num(torch_kv, k) else "–")
    print("| model | impl | rollout ms | train ms | rollout / torch | train / torch | rollout mean logp | train loss |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for variant, kv in rows:
        print(f"| {variant} | {kv.get('impl', '')} | {kv.get('rollout_ms', 'NA')} | {kv.get('train_ms', 'NA')} | "
              f"{ratio(kv, 'rollout_ms')} | {ratio(kv, 'train_ms')} | {kv.get('rollout_mean_logp', 'NA')} | "
              f"{kv.get('train_loss', 'NA')} |")
    print()
    for note in notes:
        print(f"    {note}")


def main():
    ok = True
    if len(sys.argv) > 1 and sys.argv[1] == "--table":
        table(sys.argv[2:])
        return
    if len(sys.argv) > 1:
        ok = check(sys.argv[1])
    if os.environ.get("WM_SKIP_BENCH") != "1" and torch.cuda.is_available():
        bench()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
