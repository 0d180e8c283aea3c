#!/usr/bin/env python3
"""Device harness for the sm_90a kernels (common.cuh ++ gemm_sm90.cu / linear_logp_sm90.cu).

Loads the same sources the Rust side embeds, compiled by NVRTC with the Rust options (or cubins built by
nvrtc_check.py --out DIR, passed with --cubin-dir), encodes TMA maps with cuTensorMapEncodeTiled and launches
with cuLaunchKernel through ctypes on libcuda, exactly as the ABI in kernels/README.md says. torch provides
data, the f32 references and the cuBLAS timings.
Usage: sm90_harness.py [--cubin-dir D] [--only MODES]   (default MODES = gemm,logp,perf)
MODES (comma-separated): gemm, logp (correctness/invariance checks), perf (timings vs cuBLAS), logppp (the
ping-pong logp forward = the plain one bitwise, both timed beside cuBLAS), samplepp (the same for the sampler's
pass, Gumbel and greedy), samplepass (the sampler's pass against --old-cubin's, bitwise, both timed), samplemerge
(the segment merges against --old-cubin's, bitwise, both timed), perfbwd (NT/TN
and logp-backward parts separately), ksweep (time vs K), prof (one launch each, for ncu), sanitize (small
shapes through every entry point, for compute-sanitizer), attn (attention forward: correctness vs f64 and
bitwise invariance: decode = prefill, row alone = ragged batch, chunked prefill, reruns, NaN past kv_len),
attnperf (attention forward timings beside torch SDPA flash / cuDNN), attnbwd (attention backward: gradients vs
f64, rerun, row alone = ragged batch, right padding), attnbwdperf (forward + backward beside SDPA's), attnsplit
(the split forwards: in-CTA merge = per-split CTAs + merge, = the plain forward within one split, decode =
prefill), attnlong (decode at B 1 and 8 over 32768 and 131072 keys, plain and split, beside SDPA), attnprof (one
forward each of ours and of cuDNN's SDPA at S 2048 · Dh 128 and S 4096 · Dh 64, for ncu). Exit status 1
if any check fails.
Needs no Rust build: the sources are compiled here through nvrtc_check's helpers (pip install torch and the
nvidia-cuda-nvrtc 13.0 wheels, see nvrtc_check.py).
"""
import ctypes
import math
import os
import struct
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import nvrtc_check  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

ARGS = sys.argv[1:]


def arg(name, default=None):
    return ARGS[ARGS.index(name) + 1] if name in ARGS else default


ONLY = set((arg("--only") or "gemm,logp,perf").split(","))

# ----------------------------------------------------------------------------------------------- driver
torch.cuda.init()
torch.zeros(1, device="cuda")
_cu = ctypes.CDLL("libcuda.so.1")


def ck(r, what):
    if r != 0:
        s = ctypes.c_char_p()
        _cu.cuGetErrorString(r, ctypes.byref(s))
        raise RuntimeError(f"{what} failed: {r} {s.value}")


_modules = {}


def get_module(cu):
    if cu in _modules:
        return _modules[cu]
    d = arg("--cubin-dir")
    if d and os.path.exists(os.path.join(d, cu.replace(".cu", ".cubin"))):
        cubin = open(os.path.join(d, cu.replace(".cu", ".cubin")), "rb").read()
    else:
        t = time.time()
        cubin, _ = nvrtc_check.compile_cubin(nvrtc_check.kernel_source(cu), cu)
        print(f"[nvrtc] {cu} compiled in {time.time()-t:.1f}s", flush=True)
    mod = ctypes.c_void_p()
    ck(_cu.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
    _modules[cu] = mod
    return mod


_funcs = {}


def get_func(cu, name, smem):
    key = (cu, name)
    if key not in _funcs:
        f = ctypes.c_void_p()
        ck(_cu.cuModuleGetFunction(ctypes.byref(f), get_module(cu), name.encode()), f"cuModuleGetFunction {name}")
        ck(_cu.cuFuncSetAttribute(f, 8, smem), "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        _funcs[key] = f
    return _funcs[key]


NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count


class Launch:
    """A prepared cuLaunchKernel call (parameters packed once, as a Rust launcher caching its tensor maps would)."""

    def __init__(self, cu, name, grid, block, smem, maps, buffers, params):
        self.f = get_func(cu, name, smem)
        self.grid, self.block, self.smem = grid, block, smem
        # Parameter order (README 'Build model'): tensor maps, then buffers (the maps' own buffers first), then
        # the Params struct.
        self.maps = [ctypes.create_string_buffer(bytes(m), 128) for m in maps]
        self.vals = [ctypes.c_uint64(b.data_ptr() if b is not None else _dummy.data_ptr()) for b in buffers]
        self.keep = buffers
        self.pbuf = ctypes.create_string_buffer(bytes(params), len(params))
        slots = [ctypes.addressof(m) for m in self.maps] + [ctypes.addressof(v) for v in self.vals]
        self.ptrs = (ctypes.c_void_p * (len(slots) + 1))(*slots, ctypes.addressof(self.pbuf))

    def __call__(self):
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        ck(_cu.cuLaunchKernel(self.f, self.grid, 1, 1, self.block, 1, 1, self.smem, stream, self.ptrs, None),
           "cuLaunchKernel")


RECORD = None  # when a list, launch() records prepared launches instead of running them


ENTRIES, CONSTANTS = nvrtc_check.ENTRIES, nvrtc_check.CONSTANTS  # kernels/entries.txt


def launch(name, grid, maps, buffers, params):
    """Entry point `name` of kernels/entries.txt (its file, threads and dynamic smem from there) on `grid` blocks.
    maps: encoded tensor maps (128 bytes each); buffers: list of torch tensors (None -> a dummy buffer the
    kernel never touches); params: Params bytes."""
    e = ENTRIES[name]
    l = Launch(e.file, name, grid, e.threads, e.smem, maps, buffers, params)
    if RECORD is not None:
        RECORD.append(l)
    else:
        l()


def record(fn):
    global RECORD
    RECORD = []
    fn()
    out, RECORD = RECORD, None
    return out


_dummy = torch.zeros(16, dtype=torch.float32, device="cuda")


def tmap(t, rows, cols, ld, base_off=0):
    """2D row-major [rows, cols] view of t (row stride ld elements) starting base_off elements in:
    dims {cols, rows}, box {64, 64}, 128B swizzle, zero OOB fill (README: 'Tensor maps')."""
    assert t.dtype in (torch.bfloat16, torch.float16)
    buf = ctypes.create_string_buffer(128 + 64)
    addr = (ctypes.addressof(buf) + 63) & ~63
    dt = 9 if t.dtype == torch.bfloat16 else 6
    gdim = (ctypes.c_uint64 * 2)(cols, rows)
    gstr = (ctypes.c_uint64 * 1)(ld * 2)
    box = (ctypes.c_uint32 * 2)(64, 64)
    est = (ctypes.c_uint32 * 2)(1, 1)
    ck(_cu.cuTensorMapEncodeTiled(ctypes.c_void_p(addr), dt, 2, ctypes.c_void_p(t.data_ptr() + 2 * base_off), gdim,
                                  gstr, box, est, 0, 3, 3, 0), f"cuTensorMapEncodeTiled dims=({cols},{rows}) ld={ld}")
    return ctypes.string_at(addr, 128)


def sfx(dt):
    return "bf16" if dt == torch.bfloat16 else "f16"


# ------------------------------------------------------------------------------------------------ GEMM
GEMM_BIAS, GEMM_ACC_LOAD, GEMM_ACC_STORE, GEMM_STORE_C = (CONSTANTS[k] for k in (
    "GEMM_BIAS", "GEMM_ACC_LOAD", "GEMM_ACC_STORE", "GEMM_STORE_C"))
# variant -> entry suffix (tile, threads, smem, cluster: kernels/entries.txt, the same for every layout and dtype)
VARIANT = {"big": "", "small": "_small"}


def gemm_grid(variant, M, N):
    e = ENTRIES[f"ib_gemm_nn{VARIANT[variant]}_bf16"]
    BM, BN, CL = e.rows, e.cols, e.cluster
    groups = -(-(-(-M // BM)) // CL) * -(-N // BN)
    return CL * min(groups, NUM_SMS // CL)


def gemm(layout, a, b, bias=None, out=None, variant="big", flags=None, cacc=None, c_offset=0, ldc=None, M=None,
         N=None, K=None):
    """layout nn: a[M,K] b[K,N]; nt: a[M,K] b[N,K]; tn: a[K,M] b[K,N]. Returns out[M,N] (input dtype)."""
    if layout == "nn":
        M_, K_ = a.shape; N_ = b.shape[1]
    elif layout == "nt":
        M_, K_ = a.shape; N_ = b.shape[0]
    else:
        K_, M_ = a.shape; N_ = b.shape[1]
    M = M or M_; N = N or N_; K = K or K_
    if out is None and (flags is None or flags & GEMM_STORE_C):
        out = torch.full((M, N), float("nan"), dtype=a.dtype, device="cuda")
    ldc = ldc or N
    if layout in ("nn", "nt"):
        ta = tmap(a, M, K, a.stride(0))
    else:
        ta = tmap(a, K, M, a.stride(0))
    if layout == "nt":
        tb = tmap(b, N, K, b.stride(0))
    else:
        tb = tmap(b, K, N, b.stride(0))
    if flags is None:
        flags = GEMM_STORE_C | (GEMM_BIAS if bias is not None else 0)
    params = struct.pack("<IIIIQQ", M, N, K, flags, ldc, c_offset)
    name = f"ib_gemm_{layout}{VARIANT[variant]}_{sfx(a.dtype)}"
    launch(name, gemm_grid(variant, M, N), [ta, tb], [a, b, a, b, bias, out, cacc], params)
    return out


def rel(x, ref):
    x = x.float(); ref = ref.float()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


RESULTS = []


def check(name, ok, detail=""):
    RESULTS.append((name, ok))
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {detail}", flush=True)


def rnd(*shape, dt=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dt)


def test_gemm():
    torch.manual_seed(0)
    shapes = [(1, 72, 8), (7, 136, 264), (129, 4104, 1000), (1000, 72, 264), (300, 520, 136), (64, 64, 64),
              (257, 1024, 520)]
    for dt in (torch.bfloat16, torch.float16):
        tol = 1e-2 if dt == torch.bfloat16 else 2e-3
        for layout in ("nn", "nt", "tn"):
            for variant in (("big", "small") if layout != "tn" else ("big",)):
                for (M, K, N) in shapes:
                    if layout == "tn" and M % 8:
                        M += 8 - M % 8  # TN: A[K,M] row stride M must be a multiple of 8
                    lhs = rnd(M, K, dt=dt); W = rnd(K, N, dt=dt)
                    bias = rnd(N, dt=dt) if (M + N) % 2 == 0 else None
                    if layout == "nn":
                        out = gemm("nn", lhs, W, bias, variant=variant)
                    elif layout == "nt":
                        out = gemm("nt", lhs, W.t().contiguous(), bias, variant=variant)
                    else:
                        out = gemm("tn", lhs.t().contiguous(), W, bias, variant=variant)
                    ref = lhs.float() @ W.float() + (bias.float() if bias is not None else 0)
                    e = rel(out, ref)
                    nanfree = not torch.isnan(out).any().item()
                    check(f"gemm {layout} {variant} {sfx(dt)} M={M} K={K} N={N} bias={bias is not None}",
                          e < tol and nanfree, f"rel={e:.2e} written={nanfree}")
        # NT with N not a multiple of 8 (allowed: only K-major operands)
        lhs = rnd(7, 136, dt=dt); Wt = rnd(13, 136, dt=dt)
        for variant in ("big", "small"):
            out = gemm("nt", lhs, Wt, variant=variant)
            e = rel(out, lhs.float() @ Wt.float().t())
            check(f"gemm nt {variant} {sfx(dt)} M=7 K=136 N=13", e < tol and not torch.isnan(out).any().item(),
                  f"rel={e:.2e}")

    # ---- invariance (bf16 and f16)
    for dt in (torch.bfloat16, torch.float16):
        for (K, N) in ((4096, 4096), (4104, 1000)):
            torch.manual_seed(1)
            X = rnd(4096, K, dt=dt); W = rnd(K, N, dt=dt); bias = rnd(N, dt=dt)
            full = gemm("nn", X, W, bias)
            again = gemm("nn", X, W, bias)
            check(f"determinism nn {sfx(dt)} K={K} N={N}", torch.equal(full, again))
            small_full = gemm("nn", X, W, bias, variant="small")
            check(f"small variant == big tile bitwise, M=4096 {sfx(dt)} K={K} N={N}", torch.equal(small_full, full),
                  f"mismatches={(small_full != full).sum().item()}")
            ok = True
            for r in (0, 1, 77, 128, 4095):
                for v in ("big", "small"):
                    one = gemm("nn", X[r:r + 1].contiguous(), W, bias, variant=v)
                    ok &= torch.equal(one[0], full[r])
            check(f"row alone (M=1, big and small) == row in M=4096 {sfx(dt)} K={K} N={N}", ok)
            ok = True
            for v in ("big", "small"):
                for M in (16, 64):
                    part = gemm("nn", X[100:100 + M].contiguous(), W, bias, variant=v)
                    ok &= torch.equal(part, full[100:100 + M])
            check(f"M=16/64 slices at row 100 == batch {sfx(dt)} K={K} N={N}", ok)
            pieces = [(0, 1000), (1000, 1001), (1001, 1130), (1130, 4096)]
            cat = torch.cat([gemm("nn", X[a:b].contiguous(), W, bias) for a, b in pieces])
            check(f"chunked rows (0:1000,1000:1001,1001:1130,1130:4096) == batch {sfx(dt)} K={K} N={N}",
                  torch.equal(cat, full))
            Xp = torch.cat([X, rnd(5, K, dt=dt)])
            check(f"padded M=4101 first 4096 rows == batch {sfx(dt)} K={K} N={N}",
                  torch.equal(gemm("nn", Xp, W, bias)[:4096], full))
            Xr = X.clone(); Xr[2000:] = rnd(2096, K, dt=dt)
            check(f"other rows' values do not change rows 0..1999 {sfx(dt)} K={K} N={N}",
                  torch.equal(gemm("nn", Xr, W, bias)[:2000], full[:2000]))
            # NT (dLhs / logits) invariance
            Wt = W.t().contiguous()
            fullt = gemm("nt", X, Wt)
            ok = all(torch.equal(gemm("nt", X[r:r + 1].contiguous(), Wt, variant=v)[0], fullt[r])
                     for r in (0, 333, 4095) for v in ("big", "small"))
            check(f"nt row alone == row in batch (big and small) {sfx(dt)} K={K} N={N}", ok)
            # TN: appended zero-gradient rows leave dRhs bitwise unchanged; run-to-run deterministic
            dO = rnd(4096, N, dt=dt)
            g = gemm("tn", X, dO)
            Xa = torch.cat([X, rnd(37, K, dt=dt)]); dOa = torch.cat([dO, torch.zeros(37, N, dtype=dt, device="cuda")])
            check(f"tn appended 37 zero-grad rows bitwise unchanged {sfx(dt)} K={K} N={N}",
                  torch.equal(gemm("tn", Xa, dOa), g))
            check(f"tn determinism {sfx(dt)} K={K} N={N}", torch.equal(gemm("tn", X, dO), g))
            e = rel(g, X.float().t() @ dO.float())
            check(f"tn M=4096 correctness {sfx(dt)} K={K} N={N}", e < 1e-2, f"rel={e:.2e}")
    # f32 accumulate modes (used by the linear_logp backward)
    A1 = rnd(300, 520); B1 = rnd(520, 264); A2 = rnd(300, 136); B2 = rnd(136, 264)
    acc = torch.full((300, 264), float("nan"), device="cuda")
    gemm("nn", A1, B1, flags=GEMM_ACC_STORE, cacc=acc, out=_dummy)
    out = gemm("nn", A2, B2, flags=GEMM_ACC_LOAD | GEMM_STORE_C, cacc=acc)
    ref = A1.float() @ B1.float() + A2.float() @ B2.float()
    e = rel(out, ref)
    check("gemm f32 accumulate chain (ACC_STORE then ACC_LOAD|STORE_C)", e < 1e-2, f"rel={e:.2e}")


# --------------------------------------------------------------------------------------------- logp
SEG = CONSTANTS["LOGP_SEG"]
TOKEN_CHUNK, VOCAB_CHUNK = CONSTANTS["TOKEN_CHUNK"], CONSTANTS["VOCAB_CHUNK"]
LOGP_HAS_BIAS, LOGP_HAS_IGNORE = CONSTANTS["LOGP_HAS_BIAS"], CONSTANTS["LOGP_HAS_IGNORE"]
DB_LOAD, DB_STORE_ACC, DB_STORE = (CONSTANTS[k] for k in (
    "LOGP_DBIAS_ACC_LOAD", "LOGP_DBIAS_ACC_STORE", "LOGP_DBIAS_STORE"))
MERGE, DZ, DBIAS = (ENTRIES[k] for k in ("ib_logp_merge", "ib_logp_bwd_dz_bf16", "ib_logp_bwd_dbias_bf16"))


def pass_grid(entry, N, nseg, pp):
    """The persistent grid of a forward pass, as src/backends/sm90/logp.rs `forward_pass` computes it."""
    items = -(-(-(-N // entry.rows)) // entry.cluster) * nseg  # (row-block group, segment) items
    clusters = -(-items // 2) if pp else items  # a ping-pong cluster holds two items at a time
    return entry.cluster * min(clusters, NUM_SMS // entry.cluster)


def logp_fwd(H, W, targets, bias=None, ignore_index=None, pp=False):
    N, D = H.shape; V = W.shape[0]
    fwd = ENTRIES[f"ib_logp_fwd_pp_{sfx(H.dtype)}" if pp else f"ib_logp_fwd_{sfx(H.dtype)}"]
    nseg = -(-V // SEG)
    logp = torch.full((N,), float("nan"), device="cuda"); lse = torch.full((N,), float("nan"), device="cuda")
    ws = torch.empty((nseg * N * 2,), device="cuda")
    flags = (LOGP_HAS_BIAS if bias is not None else 0) | (LOGP_HAS_IGNORE if ignore_index is not None else 0)
    maps = [tmap(H, N, D, D), tmap(W, V, D, D)]
    p = struct.pack("<IIIIqfI", N, V, D, flags, ignore_index or 0, 1.0, 0)  # temperature 1
    # wu and ent (the entropy entries' buffers) are not read without LOGP_ENTROPY: any buffer
    bufs = [H, W, H, W, bias, targets, logp, lse, ws, ws, ws]
    launch(fwd.name, pass_grid(fwd, N, nseg, pp), maps, bufs, p)
    launch("ib_logp_merge", -(-N // MERGE.rows), [], [targets, logp, lse, ws, ws, ws], p)
    return logp, lse


def logp_bwd(H, W, targets, lse, g_logp, g_lse, bias=None, ignore_index=None, tchunk=TOKEN_CHUNK,
             vchunk=VOCAB_CHUNK, ws=None):
    """Host loop the Rust side must reproduce (README 'Fused linear_logp', 'Backward')."""
    N, D = H.shape; V = W.shape[0]; dt = H.dtype
    dH = torch.empty_like(H); dW = torch.empty_like(W)
    db = torch.empty((V,), dtype=dt, device="cuda") if bias is not None else None
    ntc = -(-N // tchunk); nvc = -(-V // vchunk)
    dz = torch.empty((min(tchunk, N), vchunk), dtype=dt, device="cuda") if ws is None else ws[0]
    part = torch.empty((-(-min(tchunk, N) // DZ.rows), vchunk), device="cuda") if ws is None else ws[1]
    dH_acc = torch.empty((N, D), device="cuda") if nvc > 1 else None
    dW_acc = torch.empty((V, D), device="cuda") if ntc > 1 else None
    db_acc = torch.empty((V,), device="cuda") if (bias is not None and ntc > 1) else None
    base = (LOGP_HAS_BIAS if bias is not None else 0) | (LOGP_HAS_IGNORE if ignore_index is not None else 0)
    for vi in range(nvc):
        v0 = vi * vchunk; vw = min(vchunk, V - v0)
        for ti in range(ntc):
            t0 = ti * tchunk; tw = min(tchunk, N - t0)
            fl = base
            if bias is not None:
                fl |= (DB_LOAD if ti > 0 else 0) | (DB_STORE_ACC if ti < ntc - 1 else 0) | (DB_STORE if ti == ntc - 1 else 0)
            maps = [tmap(H, tw, D, D, t0 * D), tmap(W, vw, D, D, v0 * D)]
            p = struct.pack("<IIIIqIIIf", tw, vw, D, fl, ignore_index or 0, t0, v0, vchunk, 1.0)  # temperature 1
            # ent and g_ent are read only by the entropy entries: any buffer
            bufs = [H, W, H, W, bias, targets, lse, g_logp, g_lse, lse, lse, dz, part]
            tiles = -(-(-(-tw // DZ.rows)) // DZ.cluster) * -(-vw // DZ.cols)  # (row-block pair, vocab tile) per cluster
            launch(f"ib_logp_bwd_dz_{sfx(dt)}", DZ.cluster * min(tiles, NUM_SMS // DZ.cluster), maps, bufs, p)
            if bias is not None:
                launch(f"ib_logp_bwd_dbias_{sfx(dt)}", -(-vw // DBIAS.cols), [], [part, db_acc, db], p)
            # dH[t0:t0+tw] (+)= dz . W[v0:v0+vw]       (NN, reduction over this vocab chunk)
            fh = (GEMM_ACC_LOAD if vi > 0 else 0) | (GEMM_ACC_STORE if vi < nvc - 1 else 0) | (GEMM_STORE_C if vi == nvc - 1 else 0)
            gemm_raw("nn", dz, tmap(dz, tw, vw, vchunk), tmap(W, vw, D, D, v0 * D), tw, D, vw, fh, dH, dH_acc, t0 * D, D)
            # dW[v0:v0+vw] (+)= dz^T . H[t0:t0+tw]     (TN, reduction over this token chunk)
            fw = (GEMM_ACC_LOAD if ti > 0 else 0) | (GEMM_ACC_STORE if ti < ntc - 1 else 0) | (GEMM_STORE_C if ti == ntc - 1 else 0)
            gemm_raw("tn", dz, tmap(dz, tw, vw, vchunk), tmap(H, tw, D, D, t0 * D), vw, D, tw, fw, dW, dW_acc, v0 * D, D)
    return dH, dW, db


def gemm_raw(layout, like, ta, tb, M, N, K, flags, out, cacc, c_offset, ldc):
    params = struct.pack("<IIIIQQ", M, N, K, flags, ldc, c_offset)
    launch(f"ib_gemm_{layout}_{sfx(like.dtype)}", gemm_grid("big", M, N), [ta, tb],
           [like, like, like, like, None, out, cacc], params)


def ref_logp(H, W, targets, bias=None, ignore_index=None):
    z = H.float() @ W.float().t()
    if bias is not None:
        z = z + bias.float()
    lse = torch.logsumexp(z, dim=1)
    t = targets.long().clamp(0, W.shape[0] - 1)
    lp = z.gather(1, t[:, None])[:, 0] - lse
    if ignore_index is not None:
        lp = torch.where(targets.long() == ignore_index, torch.zeros_like(lp), lp)
    return lp, lse


def test_logp():
    torch.manual_seed(2)
    for dt in (torch.bfloat16, torch.float16):
        for (N, D, V, use_bias, ign) in [(1, 72, 1000, True, None), (7, 136, 8, False, None), (129, 264, 50257, True, -100),
                                         (300, 512, 4100, False, 5), (1000, 2048, 32768, True, None)]:
            H = rnd(N, D, dt=dt); W = rnd(V, D, dt=dt, scale=0.1); b = rnd(V, dt=dt) if use_bias else None
            tg = torch.randint(0, V, (N,), device="cuda", dtype=torch.int32)
            if ign is not None:
                tg[::3] = ign
            lp, lse = logp_fwd(H, W, tg, b, ign)
            rlp, rlse = ref_logp(H, W, tg, b, ign)
            e1 = (lp - rlp).abs().max().item(); e2 = (lse - rlse).abs().max().item()
            check(f"logp fwd {sfx(dt)} N={N} D={D} V={V} bias={use_bias} ignore={ign}", e1 < 2e-3 and e2 < 2e-3,
                  f"max|dlogp|={e1:.2e} max|dlse|={e2:.2e}")
            # backward
            gl = torch.randn(N, device="cuda"); gs = torch.randn(N, device="cuda") * 0.3
            dH, dW, db = logp_bwd(H, W, tg, lse, gl, gs, b, ign)
            Hf = H.float().requires_grad_(); Wf = W.float().requires_grad_()
            bf = b.float().requires_grad_() if b is not None else None
            z = Hf @ Wf.t() + (bf if bf is not None else 0)
            l2 = torch.logsumexp(z, 1)
            t = tg.long().clamp(0, V - 1)
            lp2 = z.gather(1, t[:, None])[:, 0] - l2
            if ign is not None:
                lp2 = torch.where(tg.long() == ign, torch.zeros_like(lp2), lp2)
            (lp2 * gl + l2 * gs).sum().backward()
            errs = [rel(dH, Hf.grad), rel(dW, Wf.grad)] + ([rel(db, bf.grad)] if b is not None else [])
            check(f"logp bwd {sfx(dt)} N={N} D={D} V={V} bias={use_bias} ignore={ign}", max(errs) < 2e-2,
                  "rel dH,dW,db=" + ",".join(f"{x:.2e}" for x in errs))
    # invariance (bf16): rows alone, chunked, padded; multi-chunk backward; dW appended zero-grad rows
    N, D, V = 4096, 1024, 20000
    H = rnd(N, D); W = rnd(V, D, scale=0.1); b = rnd(V)
    tg = torch.randint(0, V, (N,), device="cuda", dtype=torch.int32)
    lp, lse = logp_fwd(H, W, tg, b)
    lp2, lse2 = logp_fwd(H, W, tg, b)
    check("logp fwd determinism", torch.equal(lp, lp2) and torch.equal(lse, lse2))
    ok = all(torch.equal(torch.stack(logp_fwd(H[r:r + 1].contiguous(), W, tg[r:r + 1], b))[:, 0],
                         torch.stack([lp[r], lse[r]])) for r in (0, 1, 130, 4095))
    check("logp fwd row alone == row in N=4096", ok)
    pieces = [(0, 1000), (1000, 1001), (1001, 4096)]
    outs = [logp_fwd(H[a:c].contiguous(), W, tg[a:c].contiguous(), b) for a, c in pieces]
    check("logp fwd chunked == batch", torch.equal(torch.cat([o[0] for o in outs]), lp) and
          torch.equal(torch.cat([o[1] for o in outs]), lse))
    gl = torch.randn(N, device="cuda"); gs = torch.randn(N, device="cuda") * 0.3
    dH, dW, db = logp_bwd(H, W, tg, lse, gl, gs, b)
    ok = all(torch.equal(logp_bwd(H[r:r + 1].contiguous(), W, tg[r:r + 1], lse[r:r + 1], gl[r:r + 1], gs[r:r + 1], b)[0][0],
                         dH[r]) for r in (0, 77, 4095))
    check("logp bwd dHidden row alone == row in N=4096", ok)
    dH2, dW2, db2 = logp_bwd(H, W, tg, lse, gl, gs, b)
    check("logp bwd determinism", torch.equal(dH, dH2) and torch.equal(dW, dW2) and torch.equal(db, db2))
    # appended rows with zero upstream gradient: dW, dbias unchanged; with a small token chunk (several chunks)
    Ha = torch.cat([H, rnd(50, D)]); tga = torch.cat([tg, torch.randint(0, V, (50,), device="cuda", dtype=torch.int32)])
    lsea = torch.cat([lse, torch.zeros(50, device="cuda")])
    z50 = torch.zeros(50, device="cuda")
    for tc in (TOKEN_CHUNK, 1024):
        r0 = logp_bwd(H, W, tg, lse, gl, gs, b, tchunk=tc)
        r1 = logp_bwd(Ha, W, tga, lsea, torch.cat([gl, z50]), torch.cat([gs, z50]), b, tchunk=tc)
        check(f"logp bwd appended 50 zero-grad rows: dW, dbias bitwise unchanged (token chunk {tc})",
              torch.equal(r0[1], r1[1]) and torch.equal(r0[2], r1[2]) and torch.equal(r0[0], r1[0][:N]))
    r = logp_bwd(H, W, tg, lse, gl, gs, b, tchunk=1024)
    errs = [rel(r[0], dH), rel(r[1], dW), rel(r[2], db)]
    check("logp bwd token chunk 1024 (4 chunks, f32 accumulators) close to 1 chunk", max(errs) < 1e-2,
          ",".join(f"{x:.1e}" for x in errs))
    # invalid targets: no crash, NaN logp
    tgb = tg[:8].clone(); tgb[0] = -7; tgb[1] = V + 5
    lpb, lseb = logp_fwd(H[:8].contiguous(), W, tgb, b)
    torch.cuda.synchronize()
    check("logp out-of-range targets -> NaN logp, finite lse, no fault",
          bool(torch.isnan(lpb[:2]).all().item()) and bool(torch.isfinite(lseb).all().item()) and
          bool(torch.isfinite(lpb[2:]).all().item()))


# ---------------------------------------------------------------------------------------------- attention
ATTN_CAUSAL = CONSTANTS["ATTN_CAUSAL"]


ATTN_SPLIT = CONSTANTS["ATTN_SPLIT"]


def attn_fwd(q, k, v, kv_lens=None, causal=True, scale=None, out=None, lse=None, kind=""):
    """ib_attn_fwd_<T>_d<Dh> (README 'Attention'): q [B,H,Q,Dh], k/v [B,KH,KV,Dh] contiguous, kv_lens int32 [B]
    (None: KV). Returns (out [B,H,Q,Dh] in q's dtype, lse [B,H,Q] f32); out/lse are NaN-filled first unless given.
    kind "split_": the forward merging fixed splits of ATTN_SPLIT keys; "part_": one CTA per split + the merge;
    "wide_" (Dh 64): three consumer warpgroups, 192-row tiles, the same bits as "" (the op's Dh 64 forward)."""
    B, H, Q, D = q.shape
    KH, KV = k.shape[1], k.shape[2]
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and H % KH == 0 and KV >= 1
    if kv_lens is None:
        kv_lens = torch.full((B,), KV, dtype=torch.int32, device="cuda")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if scale < 0:  # the forward takes scale >= 0: the host passes -Q and |scale| (the same products)
        q, scale = -q, -scale
    if out is None:
        out = torch.full_like(q, float("nan"))
    if lse is None:
        lse = torch.full((B, H, Q), float("nan"), device="cuda")
    name = f"ib_attn_fwd_{kind}{sfx(q.dtype)}_d{D}"
    e = ENTRIES[name]
    G = H // KH
    grid = B * KH * -(-(G * Q) // e.rows)  # one CTA per (batch row, KV head, 128 packed query rows)
    maps = [tmap(q, B * H * Q, D, D), tmap(k, B * KH * KV, D, D), tmap(v, B * KH * KV, D, D)]
    params = struct.pack("<IIIIIIfI", B, H, KH, Q, KV, ATTN_CAUSAL if causal else 0, scale, 0)
    if kind != "part_":
        launch(name, grid, maps, [q, k, v, q, k, v, kv_lens, out, lse], params)
        return out, lse
    # one CTA per (tile, split), then the merge: a warp per query row
    nsp, rows = -(-KV // ATTN_SPLIT), B * H * Q
    ws_o = torch.empty(nsp * rows * D, device="cuda")
    ws_ml = torch.empty(nsp * rows * 5, device="cuda")
    launch(name, grid * nsp, maps, [q, k, v, q, k, v, kv_lens, ws_o, ws_ml], params)
    launch(f"ib_attn_merge_{sfx(q.dtype)}_d{D}", -(-rows // 8), [], [kv_lens, ws_o, ws_ml, out, lse], params)
    return out, lse


def attn_kind(B, H, KH, Q, KV, D):
    """The forward src/backends/sm90/attention.rs launches: plain within one split (Dh 64: the three-warpgroup one),
    else the in-CTA merge when the tiles fill the SMs, else one CTA per split + the merge."""
    if KV <= ATTN_SPLIT:
        return "wide_" if D == 64 else ""
    tiles = B * KH * -(-(H // KH * Q) // ENTRIES[f"ib_attn_fwd_bf16_d{D}"].rows)
    return "split_" if tiles >= torch.cuda.get_device_properties(0).multi_processor_count else "part_"


def ref_attn(q, k, v, kv_lens, causal, scale=None):
    """f64 reference of docs/CONTRACT.md 'attention semantics': (out f64, lse f64; -inf and zeros where pos < 0)."""
    B, H, Q, D = q.shape
    KH, KV = k.shape[1], k.shape[2]
    G = H // KH
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kf = k.double().repeat_interleave(G, dim=1)
    vf = v.double().repeat_interleave(G, dim=1)
    s = (q.double() @ kf.transpose(-1, -2)) * scale  # [B,H,Q,KV]
    L = kv_lens.long().to(q.device)
    j = torch.arange(KV, device=q.device)
    pos = L[:, None] - Q + torch.arange(Q, device=q.device)[None, :]  # [B,Q]
    vis = j[None, None, :] < L[:, None, None]  # [B,1,KV] -> [B,Q,KV]
    if causal:
        vis = vis & (j[None, None, :] <= pos[:, :, None])
    else:
        vis = vis.expand(B, Q, KV)
    live = pos >= 0  # [B,Q]
    vis = vis & live[:, :, None]
    s = s.masked_fill(~vis[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf where nothing is visible
    p = torch.exp(s - lse[..., None])
    p = torch.where(vis[:, None], p, torch.zeros_like(p))
    out = p @ vf
    out = torch.where(live[:, None, :, None], out, torch.zeros_like(out))
    lse = torch.where(live[:, None, :], lse, torch.full_like(lse, float("-inf")))
    return out, lse


def _lens(vals):
    return torch.tensor(vals, dtype=torch.int32, device="cuda")


_WATCH = {}


def _watchdog(what, limit_s=120):
    """A kernel that never ran before may hang (a barrier phase, a TMA byte count): exit with a FAIL line instead
    of spending the device session. Progress = a check() line; started (once) by the attention modes."""
    import threading
    started = bool(_WATCH)
    _WATCH.update(what=what, limit=limit_s)
    if started:
        return

    def watch():
        seen, since = len(RESULTS), time.time()
        while True:
            time.sleep(5)
            if len(RESULTS) != seen:
                seen, since = len(RESULTS), time.time()
            elif time.time() - since > _WATCH["limit"]:
                last = RESULTS[-1][0] if RESULTS else "none"
                print(f"[FAIL] {_WATCH['what']}: no progress for {_WATCH['limit']} s (a hung kernel?); "
                      f"last check: {last}", flush=True)
                print(f"SUMMARY: {sum(1 for _, ok in RESULTS if ok)} PASS, "
                      f"{sum(1 for _, ok in RESULTS if not ok) + 1} FAIL", flush=True)
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def test_attn():
    """Correctness vs f64 and bitwise invariance of the attention forward (README 'Attention forward')."""
    _watchdog("attn")
    torch.manual_seed(4)
    # (B, H, KH, Q, KV, kv_lens): group rows G*Q = 148 (two tiles, a head boundary inside the second), ragged
    # lens with 0 and < Q; a long one (1200 group rows, 6 key blocks: the K/V ring wraps several times); MQA and
    # G = 1; decode-sized Q = 1; KV = 1.
    cases = [(3, 8, 2, 37, 150, [150, 0, 20]), (3, 8, 2, 37, 150, [137, 64, 128]), (2, 8, 2, 300, 700, [700, 333]),
             (2, 4, 1, 5, 200, [200, 129]), (2, 2, 2, 64, 64, [64, 63]), (4, 32, 8, 1, 300, [300, 1, 128, 257]),
             (1, 2, 1, 1, 1, [1])]
    for dt in (torch.bfloat16, torch.float16):
        tol = 1e-2 if dt == torch.bfloat16 else 4e-3
        for D in (64, 128):
            for causal in (True, False):
                tag = f"{sfx(dt)} d{D} {'causal' if causal else 'full'}"
                for (B, H, KH, Q, KV, L) in cases:
                    q = rnd(B, H, Q, D, dt=dt); k = rnd(B, KH, KV, D, dt=dt); v = rnd(B, KH, KV, D, dt=dt)
                    lens = _lens(L)
                    out, lse = attn_fwd(q, k, v, lens, causal)
                    ro, rl = ref_attn(q, k, v, lens, causal)
                    e = rel(out, ro)
                    written = not (torch.isnan(out).any().item() or torch.isnan(lse).any().item())
                    fin = torch.isfinite(rl)
                    dl = (lse[fin].double() - rl[fin]).abs().max().item() if fin.any() else 0.0
                    dead_ok = bool((lse[~fin] == float("-inf")).all().item()) and \
                        bool((out[~fin] == 0).all().item())
                    check(f"attn {tag} B={B} H={H} KH={KH} Q={Q} KV={KV} lens={L}",
                          e <= tol and written and dl < 2e-3 and dead_ok,
                          f"rel={e:.2e} max|dlse|={dl:.1e} written={written} pos<0 rows zero/-inf={dead_ok}")
                    if D == 64:  # three consumer warpgroups (192-row tiles): the same operations per row
                        ow, lw = attn_fwd(q, k, v, lens, causal, kind="wide_")
                        check(f"attn wide {tag} B={B} H={H} KH={KH} Q={Q} KV={KV} lens={L}: == ib_attn_fwd bitwise",
                              torch.equal(ow, out) and torch.equal(lw, lse),
                              f"mismatches={(ow != out).sum().item()}")
                # ---- invariance on a ragged, padded batch (bitwise)
                B, H, KH, Q, KV = 3, 8, 2, 37, 150
                L = [150, 90, 41]
                q = rnd(B, H, Q, D, dt=dt); k = rnd(B, KH, KV, D, dt=dt); v = rnd(B, KH, KV, D, dt=dt)
                lens = _lens(L)
                out, lse = attn_fwd(q, k, v, lens, causal)
                # (4) rerun determinism
                o2, l2 = attn_fwd(q, k, v, lens, causal)
                check(f"attn {tag} rerun determinism", torch.equal(out, o2) and torch.equal(lse, l2))
                # (5) in-bounds garbage past kv_len (NaN K and V rows of the same buffers) changes nothing;
                # out/lse were NaN-filled before the launch, so every element is written
                kp, vp = k.clone(), v.clone()
                for b in range(B):
                    kp[b, :, L[b]:] = float("nan"); vp[b, :, L[b]:] = float("nan")
                o3, l3 = attn_fwd(q, kp, vp, lens, causal)
                check(f"attn {tag} NaN K/V past kv_len: bitwise unchanged, every element written",
                      torch.equal(out, o3) and torch.equal(lse, l3) and not torch.isnan(o3).any().item(),
                      f"mismatches={(out != o3).sum().item()}")
                # (1) decode = prefill: query s alone (Q = 1) at its position, kv_lens = pos + 1 (causal) or the
                # same kv_lens (full attention: rows with pos >= 0 only)
                pos = torch.tensor(L)[:, None] - Q + torch.arange(Q)[None, :]  # [B,Q]
                ok, bad = True, 0
                for s_ in range(Q):
                    qs = q[:, :, s_:s_ + 1].contiguous()
                    ls = _lens([max(0, L[b] - Q + s_ + 1) for b in range(B)]) if causal else lens
                    od, ld = attn_fwd(qs, kp, vp, ls, causal)
                    for b in range(B):
                        if not causal and pos[b, s_] < 0:
                            continue
                        same = torch.equal(od[b, :, 0], out[b, :, s_]) and torch.equal(ld[b, :, 0], lse[b, :, s_])
                        ok &= same
                        bad += 0 if same else 1
                check(f"attn {tag} decode (Q=1 per position, NaN past kv_len) == prefill rows bitwise", ok,
                      f"mismatching (row, position)s={bad}")
                # (2) a batch row alone (B = 1: tight cache KV = kv_len, and the padded cache) == in the ragged batch
                ok = True
                for b in range(B):
                    ot, lt = attn_fwd(q[b:b + 1].contiguous(), k[b:b + 1, :, :L[b]].contiguous(),
                                      v[b:b + 1, :, :L[b]].contiguous(), _lens([L[b]]), causal)
                    op, lp = attn_fwd(q[b:b + 1].contiguous(), kp[b:b + 1].contiguous(), vp[b:b + 1].contiguous(),
                                      _lens([L[b]]), causal)
                    ok &= torch.equal(ot[0], out[b]) and torch.equal(lt[0], lse[b])
                    ok &= torch.equal(op[0], out[b]) and torch.equal(lp[0], lse[b])
                check(f"attn {tag} row alone (tight and padded cache) == row in ragged batch", ok)
                # (2b) other heads' and rows' queries changed: this row's bits unchanged
                qx = q.clone(); qx[0] = rnd(H, Q, D, dt=dt); qx[1, 1:] = rnd(H - 1, Q, D, dt=dt)
                ox, lx = attn_fwd(qx, k, v, lens, causal)
                check(f"attn {tag} other rows/heads changed: row (b=1, h=0) and b=2 bitwise unchanged",
                      torch.equal(ox[1, 0], out[1, 0]) and torch.equal(ox[2], out[2]) and torch.equal(lx[2], lse[2]))
                # (3) chunked prefill: queries [0, Q1) then [Q1, Q) over the same cache (causal: kv_lens grows with
                # the chunk; full: the same kv_lens, rows with pos >= 0 in both calls)
                ok = True
                for Q1 in (20, 1, 36):
                    Q2 = Q - Q1
                    l1 = _lens([max(0, x - Q2) for x in L]) if causal else lens
                    oa, la = attn_fwd(q[:, :, :Q1].contiguous(), kp, vp, l1, causal)
                    ob, lb = attn_fwd(q[:, :, Q1:].contiguous(), kp, vp, lens, causal)
                    if causal:
                        ok &= torch.equal(torch.cat([oa, ob], 2), out) and torch.equal(torch.cat([la, lb], 2), lse)
                    else:
                        for b in range(B):
                            for i in range(Q):
                                if pos[b, i] < 0:
                                    continue
                                if i < Q1:
                                    if L[b] - Q1 + i >= 0:
                                        ok &= torch.equal(oa[b, :, i], out[b, :, i])
                                elif L[b] - Q2 + (i - Q1) >= 0:
                                    ok &= torch.equal(ob[b, :, i - Q1], out[b, :, i])
                check(f"attn {tag} chunked prefill (Q1 + Q2 = 37 for Q1 in 20, 1, 36) == one call", ok)
                # long: 1200 group rows, 6 key blocks (ring phases wrap), decode == prefill on sampled positions
                B2, Q2_, KV2 = 2, 300, 700
                L2 = [700, 333]
                q = rnd(B2, 8, Q2_, D, dt=dt); k = rnd(B2, 2, KV2, D, dt=dt); v = rnd(B2, 2, KV2, D, dt=dt)
                for b in range(B2):
                    k[b, :, L2[b]:] = float("nan"); v[b, :, L2[b]:] = float("nan")
                lens = _lens(L2)
                out, lse = attn_fwd(q, k, v, lens, causal)
                ok = not torch.isnan(out).any().item()
                for s_ in (0, 1, 127, 128, 200, 299):
                    ls = _lens([max(0, x - Q2_ + s_ + 1) for x in L2]) if causal else lens
                    od, ld = attn_fwd(q[:, :, s_:s_ + 1].contiguous(), k, v, ls, causal)
                    for b in range(B2):
                        if not causal and L2[b] - Q2_ + s_ < 0:
                            continue
                        ok &= torch.equal(od[b, :, 0], out[b, :, s_]) and torch.equal(ld[b, :, 0], lse[b, :, s_])
                check(f"attn {tag} long (Q=300, KV=700, NaN past kv_len): decode == prefill, written", ok)
    # scale other than 1/sqrt(Dh): a negative one (the kernel takes the block's extreme raw score: the min) and 0
    # (every visible score 0; hidden keys must still give p = 0, not 2^(-inf * 0) = NaN), causal and ragged
    q = rnd(2, 4, 9, 64); k = rnd(2, 2, 170, 64); v = rnd(2, 2, 170, 64); lens = _lens([170, 33])
    for sc in (0.3, -0.125, 0.0):
        for causal in (True, False):
            out, lse = attn_fwd(q, k, v, lens, causal, scale=sc)
            ro, rl = ref_attn(q, k, v, lens, causal, scale=sc)
            e = rel(out, ro)
            fin = torch.isfinite(rl)
            dl = (lse[fin].double() - rl[fin]).abs().max().item()
            check(f"attn bf16 d64 {'causal' if causal else 'full'} scale={sc}", e < 1e-2 and dl < 2e-3,
                  f"rel={e:.2e} max|dlse|={dl:.1e}")


def attn_bwd(q, k, v, out, lse, dout, kv_lens=None, causal=True, scale=None):
    """ib_attn_bwd_{prep,dq,dkdv}_<T>_d<Dh> (README 'Attention backward'): the forward's out/lse and dout
    [B,H,Q,Dh] -> (dq, dk, dv), NaN-filled first so every element must be written."""
    B, H, Q, D = q.shape
    KH, KV = k.shape[1], k.shape[2]
    G = H // KH
    if kv_lens is None:
        kv_lens = torch.full((B,), KV, dtype=torch.int32, device="cuda")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    sf = sfx(q.dtype)
    params = struct.pack("<IIIIIIfI", B, H, KH, Q, KV, ATTN_CAUSAL if causal else 0, scale, 0)
    qz = torch.full_like(q, float("nan"))
    rows = torch.full((B * H * Q, 4), float("nan"), device="cuda")
    launch(f"ib_attn_bwd_prep_{sf}_d{D}", -(-(B * H * Q) // 8), [], [kv_lens, q, out, dout, lse, qz, rows], params)
    dq = torch.full_like(q, float("nan"))
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    mq, mo = tmap(q, B * H * Q, D, D), tmap(dout, B * H * Q, D, D)
    mk, mv = tmap(k, B * KH * KV, D, D), tmap(v, B * KH * KV, D, D)
    launch(f"ib_attn_bwd_dq_{sf}_d{D}", B * KH * -(-(G * Q) // 128), [mq, mo, mk, mv],
           [q, dout, k, v, q, dout, k, v, kv_lens, rows, dq], params)
    mz = tmap(qz, B * H * Q, D, D)
    launch(f"ib_attn_bwd_dkdv_{sf}_d{D}", B * KH * -(-KV // 128), [mz, mo, mk, mv],
           [qz, dout, k, v, qz, dout, k, v, kv_lens, rows, dk, dv], params)
    return dq, dk, dv


def ref_attn_bwd(q, k, v, dout, kv_lens, causal, scale=None):
    """f64 gradients of docs/CONTRACT.md 'attention semantics' (p = 0 where a query does not see a key)."""
    B, H, Q, D = q.shape
    KH, KV = k.shape[1], k.shape[2]
    G = H // KH
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qd, kf, vf, g = q.double(), k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1), dout.double()
    s = (qd @ kf.transpose(-1, -2)) * scale
    L = kv_lens.long().to(q.device)
    j = torch.arange(KV, device=q.device)
    pos = L[:, None] - Q + torch.arange(Q, device=q.device)[None, :]
    vis = j[None, None, :] < L[:, None, None]
    vis = vis & (j[None, None, :] <= pos[:, :, None]) if causal else vis.expand(B, Q, KV)
    vis = (vis & (pos >= 0)[:, :, None])[:, None]
    s = s.masked_fill(~vis, float("-inf"))
    m = s.amax(-1, keepdim=True).clamp(min=-1e300)
    p = torch.where(vis, torch.exp(s - m), torch.zeros_like(s))
    den = p.sum(-1, keepdim=True)
    p = p / torch.where(den > 0, den, torch.ones_like(den))
    o = p @ vf
    dp = g @ vf.transpose(-1, -2)
    ds = p * (dp - (g * o).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = ((ds.transpose(-1, -2) @ qd) * scale).view(B, KH, G, KV, D).sum(2)
    dv = (p.transpose(-1, -2) @ g).view(B, KH, G, KV, D).sum(2)
    return dq, dk, dv


def test_attn_bwd():
    """Gradients vs f64 and bitwise invariance of the attention backward (README 'Attention backward')."""
    _watchdog("attnbwd")
    torch.manual_seed(6)
    cases = [(3, 8, 2, 37, 150, [150, 0, 20]), (2, 8, 2, 300, 700, [700, 333]), (2, 4, 1, 5, 200, [200, 129]),
             (2, 2, 2, 64, 64, [64, 63]), (1, 2, 1, 1, 1, [1])]
    for dt in (torch.bfloat16, torch.float16):
        for D in (64, 128):
            for causal in (True, False):
                tag = f"{sfx(dt)} d{D} {'causal' if causal else 'full'}"
                for (B, H, KH, Q, KV, L) in cases:
                    q = rnd(B, H, Q, D, dt=dt); k = rnd(B, KH, KV, D, dt=dt); v = rnd(B, KH, KV, D, dt=dt)
                    do = rnd(B, H, Q, D, dt=dt)
                    lens = _lens(L)
                    out, lse = attn_fwd(q, k, v, lens, causal)
                    dq, dk, dv = attn_bwd(q, k, v, out, lse, do, lens, causal)
                    rq, rk, rv = ref_attn_bwd(q, k, v, do, lens, causal)
                    # relative error; absolute where the exact gradient is ~0 (one visible key: dS = 0)
                    errs = [rel(x, r) if r.norm().item() > 1e-6 else (x.double() - r).abs().max().item()
                            for x, r in ((dq, rq), (dk, rk), (dv, rv))]
                    written = not any(torch.isnan(t).any().item() for t in (dq, dk, dv))
                    zero_ok = True
                    for b in range(B):
                        zero_ok &= bool((dk[b, :, L[b]:] == 0).all().item()) and bool((dv[b, :, L[b]:] == 0).all().item())
                        for i in range(Q):
                            if L[b] - Q + i < 0:
                                zero_ok &= bool((dq[b, :, i] == 0).all().item())
                    check(f"attnbwd {tag} B={B} H={H} KH={KH} Q={Q} KV={KV} lens={L}",
                          max(errs) < 2e-2 and written and zero_ok,
                          "rel dq/dk/dv=" + "/".join(f"{e:.1e}" for e in errs) + f" written={written} zeros={zero_ok}")
                # invariance: rerun, right padding (NaN in the padding, zero upstream), row alone vs ragged batch
                B, H, KH, Q, KV = 3, 8, 2, 37, 150
                L = [150, 90, 41]
                q = rnd(B, H, Q, D, dt=dt); k = rnd(B, KH, KV, D, dt=dt); v = rnd(B, KH, KV, D, dt=dt)
                do = rnd(B, H, Q, D, dt=dt)
                kp, vp = k.clone(), v.clone()
                for b in range(B):
                    kp[b, :, L[b]:] = float("nan"); vp[b, :, L[b]:] = float("nan")
                lens = _lens(L)
                out, lse = attn_fwd(q, kp, vp, lens, causal)
                g1 = attn_bwd(q, kp, vp, out, lse, do, lens, causal)
                g2 = attn_bwd(q, kp, vp, out, lse, do, lens, causal)
                check(f"attnbwd {tag} rerun determinism", all(torch.equal(a, b_) for a, b_ in zip(g1, g2)))
                ok = True
                for b in range(B):
                    qs, ks, vs_ = q[b:b + 1].contiguous(), k[b:b + 1, :, :L[b]].contiguous(), v[b:b + 1, :, :L[b]].contiguous()
                    lb = _lens([L[b]])
                    o1, l1 = attn_fwd(qs, ks, vs_, lb, causal)
                    a = attn_bwd(qs, ks, vs_, o1, l1, do[b:b + 1].contiguous(), lb, causal)
                    ok &= torch.equal(a[0][0], g1[0][b]) and torch.equal(a[1][0], g1[1][b, :, :L[b]]) and \
                        torch.equal(a[2][0], g1[2][b, :, :L[b]])
                check(f"attnbwd {tag} row alone (tight cache) == row in ragged batch (NaN past kv_len)", ok)
                if causal:
                    # a trainer's right padding: S = 150 -> 170, other (finite) q/k/v in the padding, zero upstream
                    # there. Finite: a key within kv_len that a query does not see still meets p = 0 in the MMA
                    S, P = 150, 170
                    q1 = rnd(1, H, S, D, dt=dt); k1 = rnd(1, KH, S, D, dt=dt); v1 = rnd(1, KH, S, D, dt=dt)
                    d1 = rnd(1, H, S, D, dt=dt)
                    pad = lambda t: torch.cat([t, 8 * torch.randn_like(t[:, :, :P - S])], 2).contiguous()
                    o1, l1 = attn_fwd(q1, k1, v1, None, True)
                    a = attn_bwd(q1, k1, v1, o1, l1, d1, None, True)
                    qp, kp1, vp1 = pad(q1), pad(k1), pad(v1)
                    dp1 = torch.cat([d1, torch.zeros_like(d1[:, :, :P - S])], 2).contiguous()
                    op, lp = attn_fwd(qp, kp1, vp1, None, True)
                    c = attn_bwd(qp, kp1, vp1, op, lp, dp1, None, True)
                    ok = all(torch.equal(x[:, :, :S], y) for x, y in zip(c, a))
                    ok &= all(bool((x[:, :, S:] == 0).all().item()) for x in c)
                    check(f"attnbwd {tag} right padding 150 -> 170 (zero upstream): bitwise, padding zero", ok)


def attn_bwd_perf():
    """Forward + backward timings beside torch SDPA (flash, cuDNN) fwd + bwd, same process, medians."""
    dt = torch.bfloat16
    _watchdog("attnbwdperf", limit_s=300)
    shapes = [(8, 32, 8, 2048, 128), (8, 32, 8, 4096, 128), (4, 32, 8, 4096, 64)]
    print("\n| shape | ours fwd ms | ours bwd ms | ours fwd+bwd ms | SDPA flash fwd+bwd | SDPA cuDNN fwd+bwd | ours/flash | ours/cuDNN |")
    print("|---|---|---|---|---|---|---|---|")
    for (B, H, KH, S, D) in shapes:
        torch.manual_seed(7)
        q = rnd(B, H, S, D, dt=dt); k = rnd(B, KH, S, D, dt=dt); v = rnd(B, KH, S, D, dt=dt); do = rnd(B, H, S, D, dt=dt)
        out = torch.empty_like(q); lse = torch.empty((B, H, S), device="cuda")
        fwd = runner(record(lambda: attn_fwd(q, k, v, None, True, out=out, lse=lse)))
        fwd(); torch.cuda.synchronize()
        bwd = runner(record(lambda: attn_bwd(q, k, v, out, lse, do, None, True)))
        t_f, t_b = bench(fwd), bench(bwd)
        res = {}
        for backend in ("flash", "cudnn"):
            qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
            fn = sdpa_fn(qq, kk, vv, True, backend)
            if fn is None:
                continue
            step = lambda: torch.autograd.grad(fn(), (qq, kk, vv), do)
            try:
                step(); torch.cuda.synchronize()
                res[backend] = bench(step)
            except Exception as e:
                print(f"  SDPA {backend} backward: unavailable ({type(e).__name__}: {str(e)[:120]})", flush=True)
        t = t_f + t_b
        f_, c_ = res.get("flash"), res.get("cudnn")
        fmt = lambda x: f"{x:.3f}" if x else "-"
        ratio = lambda x: f"{t / x:.2f}" if x else "-"
        print(f"| B={B} H={H}/{KH} S={S} Dh={D} causal | {t_f:.3f} | {t_b:.3f} | {t:.3f} | {fmt(f_)} | {fmt(c_)} | "
              f"{ratio(f_)} | {ratio(c_)} |", flush=True)
        check(f"attnbwdperf B={B} S={S} Dh={D}: timed", True)


def test_attn_split():
    """The split forwards (README 'Fixed splits'): in-CTA merge (split_) = one CTA per split + merge (part_),
    bitwise, on rows that cross splits; both = the plain forward on rows within one split; decode = prefill."""
    _watchdog("attnsplit")
    torch.manual_seed(8)
    for dt in (torch.bfloat16, torch.float16):
        tol = 1e-2 if dt == torch.bfloat16 else 4e-3
        for D in (64, 128):
            for causal in (True, False):
                tag = f"{sfx(dt)} d{D} {'causal' if causal else 'full'}"
                # within one split: the same bits as the plain forward
                for (B, H, KH, Q, KV, L) in ((3, 8, 2, 37, 150, [150, 0, 20]), (2, 8, 2, 300, 700, [700, 333])):
                    q = rnd(B, H, Q, D, dt=dt); k = rnd(B, KH, KV, D, dt=dt); v = rnd(B, KH, KV, D, dt=dt)
                    lens = _lens(L)
                    ref = attn_fwd(q, k, v, lens, causal)
                    ok = all(torch.equal(a, b) for kind in ("split_", "part_")
                             for a, b in zip(attn_fwd(q, k, v, lens, causal, kind=kind), ref))
                    check(f"attnsplit {tag} KV={KV}: split = part = plain forward (one split)", ok)
                # across splits: 9000 keys (3 splits), 5000 (2), 3000 (1: = plain), NaN past kv_len
                B, H, KH, Q, KV, L = 3, 4, 1, 200, 9000, [9000, 5000, 3000]
                q = rnd(B, H, Q, D, dt=dt); k = rnd(B, KH, KV, D, dt=dt); v = rnd(B, KH, KV, D, dt=dt)
                for b in range(B):
                    k[b, :, L[b]:] = float("nan"); v[b, :, L[b]:] = float("nan")
                lens = _lens(L)
                o1, l1 = attn_fwd(q, k, v, lens, causal, kind="split_")
                o2, l2 = attn_fwd(q, k, v, lens, causal, kind="part_")
                o0, l0 = attn_fwd(q, k, v, lens, causal)
                kf, vf = k.clone(), v.clone()
                for b in range(B):
                    kf[b, :, L[b]:] = 0; vf[b, :, L[b]:] = 0
                ro, rl_ = ref_attn(q, kf, vf, lens, causal)
                e = rel(o1, ro)
                written = not (torch.isnan(o1).any().item() or torch.isnan(o2).any().item())
                check(f"attnsplit {tag} KV=9000 lens={L}: split = part bitwise, vs f64, written",
                      torch.equal(o1, o2) and torch.equal(l1, l2) and e <= tol and written, f"rel={e:.2e}")
                check(f"attnsplit {tag} row within one split (3000 keys) = plain forward",
                      torch.equal(o1[2], o0[2]) and torch.equal(l1[2], l0[2]))
                ok = True
                for s_ in (0, 1, 100, 199):
                    ls = _lens([max(0, x - Q + s_ + 1) for x in L]) if causal else lens
                    for kind in ("part_", "split_"):
                        od, ld = attn_fwd(q[:, :, s_:s_ + 1].contiguous(), k, v, ls, causal, kind=kind)
                        for b in range(B):
                            if not causal and L[b] - Q + s_ < 0:
                                continue
                            ok &= torch.equal(od[b, :, 0], o1[b, :, s_]) and torch.equal(ld[b, :, 0], l1[b, :, s_])
                check(f"attnsplit {tag} decode (Q=1, split and part) = prefill rows bitwise", ok)
                ok = True
                for b in range(B):
                    oa, la = attn_fwd(q[b:b + 1].contiguous(), k[b:b + 1, :, :L[b]].contiguous(),
                                      v[b:b + 1, :, :L[b]].contiguous(), _lens([L[b]]), causal, kind="part_")
                    ok &= torch.equal(oa[0], o1[b]) and torch.equal(la[0], l1[b])
                check(f"attnsplit {tag} row alone (tight cache, part) = row in the ragged batch", ok)


def attn_long_perf():
    """Long-context decode: the plain forward and the split one (part + merge) beside SDPA."""
    dt = torch.bfloat16
    _watchdog("attnlong", limit_s=300)
    print("\n| decode | plain ms | split (part + merge) ms | SDPA flash ms | SDPA cuDNN ms | plain / cuDNN | split / cuDNN | split GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for B in (1, 8):
        for KV in (32768, 131072):
            torch.manual_seed(9)
            q = rnd(B, 32, 1, 128, dt=dt); k = rnd(B, 8, KV, 128, dt=dt); v = rnd(B, 8, KV, 128, dt=dt)
            out = torch.empty_like(q); lse = torch.empty((B, 32, 1), device="cuda")
            plain = runner(record(lambda: attn_fwd(q, k, v, None, True, out=out, lse=lse)))
            plain(); torch.cuda.synchronize(); o0 = out.clone()
            part = runner(record(lambda: attn_fwd(q, k, v, None, True, out=out, lse=lse, kind="part_")))
            part(); torch.cuda.synchronize()
            same_rows = torch.equal(out, o0) if KV <= ATTN_SPLIT else True
            t0, t1 = bench(plain), bench(part)
            res, err = {}, float("nan")
            for backend in ("flash", "cudnn"):
                fn = sdpa_fn(q, k, v, False, backend)
                if fn is not None:
                    if backend == "flash":
                        err = rel(out, fn())
                    res[backend] = bench(fn)
            f_, c_ = res.get("flash"), res.get("cudnn")
            byts = 2 * B * 8 * KV * 128 * 2
            print(f"| B={B} x {KV} keys | {t0:.4f} | {t1:.4f} | {f_ or 0:.4f} | {c_ or 0:.4f} | "
                  f"{t0 / c_ if c_ else 0:.2f} | {t1 / c_ if c_ else 0:.2f} | {byts / t1 / 1e6:.0f} |", flush=True)
            check(f"attnlong B={B} KV={KV}: split output vs SDPA", err < 1e-2 and same_rows, f"rel={err:.1e}")


def sdpa_fn(q, k, v, causal, backend):
    """torch SDPA on one backend; GQA through enable_gqa, else K/V expanded once outside the timed call."""
    from torch.nn.attention import sdpa_kernel, SDPBackend
    bk = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    G = q.shape[1] // k.shape[1]
    F = torch.nn.functional.scaled_dot_product_attention

    def gqa():
        with sdpa_kernel([bk]):
            return F(q, k, v, is_causal=causal, enable_gqa=True)

    try:
        gqa(); torch.cuda.synchronize()
        return gqa
    except Exception:  # backend without GQA: expanded K/V
        ke, ve = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)

        def expanded():
            with sdpa_kernel([bk]):
                return F(q, ke, ve, is_causal=causal)
        try:
            expanded(); torch.cuda.synchronize()
            return expanded
        except Exception as e:
            print(f"  SDPA {backend}: unavailable ({type(e).__name__}: {str(e)[:120]})", flush=True)
            return None


def attn_perf():
    """Forward timings beside torch SDPA (flash, cuDNN) in the same process; medians of CUDA-event samples. Ours is
    the forward the op dispatches to (attn_kind)."""
    dt = torch.bfloat16
    rows = []
    _watchdog("attnperf", limit_s=300)
    # (label, B, H, KH, Q, KV, D, causal): prefill Q = KV (causal), decode Q = 1 over KV keys (sees all of them)
    shapes = [("prefill", 8, 32, 8, 2048, 2048, 128, True), ("prefill", 8, 32, 8, 4096, 4096, 128, True),
              ("prefill", 4, 32, 8, 4096, 4096, 64, True), ("decode", 64, 32, 8, 1, 4096, 128, True)]
    for (label, B, H, KH, Q, KV, D, causal) in shapes:
        torch.manual_seed(5)
        q = rnd(B, H, Q, D, dt=dt); k = rnd(B, KH, KV, D, dt=dt); v = rnd(B, KH, KV, D, dt=dt)
        out = torch.empty_like(q); lse = torch.empty((B, H, Q), device="cuda")
        kind = attn_kind(B, H, KH, Q, KV, D)  # as the op dispatches
        ours = runner(record(lambda: attn_fwd(q, k, v, None, causal, out=out, lse=lse, kind=kind)))
        ours(); torch.cuda.synchronize()
        # SDPA's is_causal is top-left aligned when Q != KV: decode uses no mask (the last query sees every key)
        sd_causal = causal and Q == KV
        ref = None
        t_ours = bench(ours)
        res = {"ours": t_ours}
        for backend in ("flash", "cudnn"):
            fn = sdpa_fn(q, k, v, sd_causal, backend)
            if fn is None:
                continue
            if ref is None:
                ref = fn()
            res[backend] = bench(fn)
        if kind == "wide_":  # the two-warpgroup forward beside it (the same bits)
            two = runner(record(lambda: attn_fwd(q, k, v, None, causal, out=out, lse=lse, kind="")))
            res["two"] = bench(two)
            print(f"  two consumer warpgroups: {res['two']:.4f} ms", flush=True)
            ours()
            torch.cuda.synchronize()
        err = rel(out, ref) if ref is not None else float("nan")
        check(f"attnperf {label} B={B} Q={Q} KV={KV} Dh={D}: output vs SDPA", ref is None or err < 1e-2,
              f"rel={err:.1e}")
        if label == "prefill":
            fl = 4 * B * H * Q * KV * D * (0.5 if causal else 1.0)
        else:
            fl = 4 * B * H * Q * KV * D
        byts = 2 * B * KH * KV * D * 2 + 2 * B * H * Q * D * 2
        rows.append((label, f"B={B} H={H}/{KH} Q={Q} KV={KV} Dh={D}{' causal' if causal else ''}", res, fl, byts, err))
        print(f"  {label} B={B} Q={Q} KV={KV} Dh={D}: ours {t_ours:.4f} ms, " +
              ", ".join(f"{k_} {t:.4f} ms" for k_, t in res.items() if k_ != "ours") + f", rel vs SDPA {err:.1e}",
              flush=True)
    print("\n| case | shape | ours ms | TFLOP/s | GB/s | SDPA flash ms | SDPA cuDNN ms | ours/flash | ours/cuDNN | rel vs SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (label, shape, res, fl, byts, err) in rows:
        t = res["ours"]
        f_ = res.get("flash"); c_ = res.get("cudnn")
        fmt = lambda x: f"{x:.4f}" if x else "-"
        ratio = lambda x: f"{t / x:.2f}" if x else "-"
        print(f"| {label} | {shape} | {t:.4f} | {fl / t / 1e9:.0f} | {byts / t / 1e6:.0f} | {fmt(f_)} | {fmt(c_)} | "
              f"{ratio(f_)} | {ratio(c_)} | {err:.1e} |", flush=True)


# --------------------------------------------------------------------------------------------- perf
def bench(fn, iters=15, reps=None):
    """Median over `iters` samples of (events around `reps` back-to-back calls) / reps, after warm-up."""
    fn(); torch.cuda.synchronize()
    if reps is None:  # aim for >= ~2 ms per sample so host launch overhead is hidden behind queued work
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        reps = max(1, min(200, int(2.0 / max(s.elapsed_time(e), 1e-3))))
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) / reps)
    ts.sort()
    return ts[len(ts) // 2]


def bench_pair(fa, fb, rounds=4, iters=5):
    """Alternate the two measurements (drift and clock changes hit both); medians over all samples."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(bench(fa, iters=iters)); tb.append(bench(fb, iters=iters))
    ta.sort(); tb.sort()
    return ta[len(ta) // 2], tb[len(tb) // 2]


def runner(launches):
    def go():
        for l in launches:
            l()
    return go


PERF = []


def logp_pingpong():
    """The ping-pong forward (ib_logp_fwd_pp_*) against the plain one: the same bits for ragged N and V (with bias,
    ignore_index, NaN rows), then both timed beside one cuBLAS GEMM of the same shape."""
    print("\n== linear_logp forward: ping-pong = plain, bitwise ==", flush=True)
    for dt in (torch.bfloat16, torch.float16):
        for (N, D, V) in ((1, 64, 1000), (37, 136, 50021), (64, 4096, 128256), (65, 200, 3001), (130, 64, 2049),
                          (1000, 512, 32771)):
            H = rnd(N, D, dt=dt); W = rnd(V, D, dt=dt, scale=0.5); b = rnd(V, dt=dt)
            tg = torch.randint(0, V, (N,), device="cuda", dtype=torch.int32)
            if N > 2:
                H[N // 2, 3] = float("nan"); tg[1] = -100
            a = logp_fwd(H, W, tg, b, -100)
            z = logp_fwd(H, W, tg, b, -100, pp=True)
            same = all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, z))
            check(f"logp pp = plain {dt} N={N} D={D} V={V}", same)
    print("\n== linear_logp forward: ping-pong vs plain vs cuBLAS (bf16, D 4096, V 128256) ==", flush=True)
    W = rnd(128256, 4096, scale=0.5)
    for N in (int(n) for n in (arg("--rows") or "64,4096").split(",")):
        H = rnd(N, 4096)
        tg = torch.randint(0, 128256, (N,), device="cuda", dtype=torch.int32)
        plain = runner(record(lambda: logp_fwd(H, W, tg)))
        pp = runner(record(lambda: logp_fwd(H, W, tg, pp=True)))
        t_plain, t_pp = bench_pair(plain, pp)
        t_cb = bench(lambda: torch.matmul(H, W.t()))
        print(f"RESULT logp fwd N={N}: plain {t_plain:.4f} ms, ping-pong {t_pp:.4f} ms, cuBLAS GEMM {t_cb:.4f} ms; "
              f"plain/GEMM {t_plain / t_cb:.3f}, pp/GEMM {t_pp / t_cb:.3f}", flush=True)


def sample_pass(H, W, keys, noise, pp=False, seed=1):
    """The sampler's pass and merge (as src/backends/sm90/logp.rs launches them), no entropy: the `[N]` columns
    logp, lse and token of the merge's `[N, 3]` output."""
    N, D = H.shape; V = W.shape[0]
    sp = ENTRIES[f"ib_logp_sample_pp_{sfx(H.dtype)}" if pp else f"ib_logp_sample_{sfx(H.dtype)}"]
    merge = ENTRIES["ib_logp_sample_merge"]
    nseg = -(-V // SEG)
    out = torch.empty((N, 3), device="cuda")  # logp, lse, token
    ws = torch.empty((nseg * N * 2,), device="cuda"); cand = torch.empty((nseg * N * 4,), device="cuda")
    p = struct.pack("<IIIIqfIIIII", N, V, D, 0, 0, 1.0, 0, seed & 0xFFFFFFFF, seed >> 32, int(noise), 0)
    launch(sp.name, pass_grid(sp, N, nseg, pp), [tmap(H, N, D, D), tmap(W, V, D, D)],
           [H, W, H, W, H, keys, ws, ws, cand], p)  # the maps' buffers, then the entry's
    launch(merge.name, -(-N // merge.rows), [], [out, ws, ws, cand], p)
    return [out[:, c] for c in range(3)]


def sample_merge():
    """The segment merges (ib_logp_merge, ib_logp_sample_merge) against another build's (--old-cubin FILE: a
    whole-file linear_logp_sm90 cubin from nvrtc_check.py --full --out): from one pass's partials (copied: the old
    merges work in place), the same outputs bitwise, with and without the entropy, Gumbel and greedy, at V of 1,
    9, 126, 130 and 256 segments (the register tree: within lanes, then every shuffle level) and of 293 (past it,
    in place); then both timed at V 128256 (bf16, D 4096, rows of --rows). `linear_logp`'s merge keeps its
    signature: --cubin-dir must hold this build's cubins, or its check compares the old build with itself."""
    print("\n== linear_logp / linear_sample merges: this build vs --old-cubin (bf16, D 4096) ==", flush=True)
    mod = ctypes.c_void_p()
    ck(_cu.cuModuleLoadData(ctypes.byref(mod), open(arg("--old-cubin"), "rb").read()), "cuModuleLoadData(old)")
    old = {}
    for name in ("ib_logp_merge", "ib_logp_sample_merge"):
        old[name] = ctypes.c_void_p()
        ck(_cu.cuModuleGetFunction(ctypes.byref(old[name]), mod, name.encode()), f"cuModuleGetFunction(old {name})")
    ent_flag = CONSTANTS["LOGP_ENTROPY"]
    D = 4096
    for V in (128256, 1000, 9 * 1024, 130 * 1024, 262144, 300000):
        W = rnd(V, D, scale=0.5)
        nseg = -(-V // SEG)
        for N in (int(n) for n in (arg("--rows") or "64,4096").split(",")):
            H = rnd(N, D, scale=0.05)
            keys = torch.arange(N, device="cuda", dtype=torch.int32)
            maps = [tmap(H, N, D, D), tmap(W, V, D, D)]
            for ent in (False, True):
                e = "_ent" if ent else ""
                flags = ent_flag if ent else 0
                ws = torch.empty((nseg * N * 2,), device="cuda"); wu = torch.empty((nseg * N,), device="cuda")

                def compare(what, name, grid, new_bufs, new_out, old_bufs, old_out, p):
                    merge = ENTRIES[name]
                    runs = {}
                    for which, bufs, outs in (("new", new_bufs, new_out), ("old", old_bufs, old_out)):
                        l = Launch(merge.file, name, grid, merge.threads, merge.smem, [], bufs, p)
                        if which == "old":
                            l.f = old[name]
                        l()
                        torch.cuda.synchronize()
                        runs[which] = (outs, l)
                    same = all(torch.equal(x.contiguous().view(torch.int32), y.contiguous().view(torch.int32))
                               for x, y in zip(runs["new"][0], runs["old"][0]))
                    check(f"{what} merge = old merge V={V} N={N}{e}", same)
                    if V == 128256:
                        t_new, t_old = bench_pair(runs["new"][1], runs["old"][1])
                        print(f"RESULT {what} merge V={V} N={N}{e}: new {t_new * 1e3:.2f} us, old {t_old * 1e3:.2f} us",
                              flush=True)

                # linear_logp: the pass writes z_t into logp, the merge turns it into logp.
                fwd = ENTRIES[f"ib_logp_fwd_pp{e}_{sfx(H.dtype)}"]
                p = struct.pack("<IIIIqfI", N, V, D, flags, 0, 1.0, 0)
                z_t = torch.full((N,), float("nan"), device="cuda")
                launch(fwd.name, pass_grid(fwd, N, nseg, True), maps,
                       [H, W, H, W, H, keys, z_t, z_t.clone(), ws, wu, z_t.clone()], p)
                outs = {w: [z_t.clone(), torch.empty((N,), device="cuda"), torch.empty((N,), device="cuda"),
                            ws.clone(), wu.clone()] for w in ("new", "old")}
                bufs = {w: [keys, o[0], o[1], o[3], o[4], o[2]] for w, o in outs.items()}
                grid = -(-N // MERGE.rows)
                compare("logp", "ib_logp_merge", grid, bufs["new"], outs["new"][:3 if ent else 2], bufs["old"],
                        outs["old"][:3 if ent else 2], p)
                # linear_sample: Gumbel and greedy.
                sp = ENTRIES[f"ib_logp_sample_pp{e}_{sfx(H.dtype)}"]
                for noise, rule in ((1, "gumbel"), (0, "greedy")):
                    cand = torch.empty((nseg * N * 4,), device="cuda")
                    p = struct.pack("<IIIIqfIIIII", N, V, D, flags, 0, 1.0, 0, 1, 0, noise, 0)
                    launch(sp.name, pass_grid(sp, N, nseg, True), maps, [H, W, H, W, H, keys, ws, wu, cand], p)
                    c = 3 if ent else 2
                    stats = torch.empty((N, c + 1), device="cuda")  # logp, lse[, entropy], token
                    new_out = [stats[:, j] for j in range(c + 1)]
                    o = [torch.empty((N,), device="cuda") for _ in range(4)]  # logp, lse, entropy, token
                    w_old, u_old = ws.clone(), wu.clone()
                    old_bufs = [o[0], o[1], w_old, u_old, o[2], cand, o[3]]
                    old_out = [o[0], o[1]] + ([o[2]] if ent else []) + [o[3]]
                    compare(f"sample {rule}", "ib_logp_sample_merge", -(-N // ENTRIES["ib_logp_sample_merge"].rows),
                            [stats, ws.clone(), wu.clone(), cand], new_out, old_bufs, old_out, p)
        del W


def sample_pass_vs_old():
    """The sampler's pass of this build against another build's (--old-cubin FILE: a whole-file linear_logp_sm90
    cubin from nvrtc_check.py --full --out): from the same inputs, the same partials (the segments' softmax sums
    and candidates) bitwise, Gumbel and greedy, with and without the entropy, 128-row and ping-pong, logits flat
    and peaked, with a bias and a NaN row; then both timed at D 4096, V 128256 (rows of --rows) beside cuBLAS."""
    print("\n== linear_sample pass: this build vs --old-cubin ==", flush=True)
    if not arg("--old-cubin"):
        sys.exit("samplepass needs --old-cubin FILE (nvrtc_check.py --out of the build to compare against)")
    mod = ctypes.c_void_p()
    ck(_cu.cuModuleLoadData(ctypes.byref(mod), open(arg("--old-cubin"), "rb").read()), "cuModuleLoadData(old)")
    ent_flag = CONSTANTS["LOGP_ENTROPY"]

    def prepare(H, W, b, keys, noise, ent, pp, seed):
        """The pass's launch, this build's and the old one's, each with its own partials."""
        N, D = H.shape; V = W.shape[0]
        e = "_ent" if ent else ""
        entry = ENTRIES[f"ib_logp_sample{'_pp' if pp else ''}{e}_{sfx(H.dtype)}"]
        nseg = -(-V // SEG)
        flags = (ent_flag if ent else 0) | (1 if b is not None else 0)
        p = struct.pack("<IIIIqfIIIII", N, V, D, flags, 0, 0.8, 0, seed, 0, noise, 0)
        runs = []
        for which in ("new", "old"):
            outs = [torch.full((nseg * N * 2,), float("nan"), device="cuda"),
                    torch.full((nseg * N,), float("nan"), device="cuda"),
                    torch.full((nseg * N * 4,), float("nan"), device="cuda")]
            l = Launch(entry.file, entry.name, pass_grid(entry, N, nseg, pp), entry.threads, entry.smem,
                       [tmap(H, N, D, D), tmap(W, V, D, D)], [H, W, H, W, b, keys] + outs, p)
            if which == "old":
                l.f = ctypes.c_void_p()
                ck(_cu.cuModuleGetFunction(ctypes.byref(l.f), mod, entry.name.encode()), f"old {entry.name}")
                ck(_cu.cuFuncSetAttribute(l.f, 8, entry.smem), "cuFuncSetAttribute(old)")
            runs.append((l, outs if ent else outs[:1] + outs[2:]))
        return runs

    for dt in (torch.bfloat16, torch.float16):
        for (N, D, V) in ((1, 64, 1000), (37, 136, 50021), (64, 4096, 128256), (130, 64, 2049), (1000, 512, 32771)):
            for logits, scale in (("flat", 0.002), ("peaked", 0.5)):
                H = rnd(N, D, dt=dt); W = rnd(V, D, dt=dt, scale=scale); b = rnd(V, dt=dt, scale=scale)
                if N > 2:
                    H[N // 2, 3] = float("nan")
                keys = torch.arange(N, device="cuda", dtype=torch.int32) * 7 + 3
                for noise, ent, pp, bias, seed in ((1, False, False, b, 1), (1, True, True, None, 2),
                                                   (1, False, True, b, 3), (0, False, True, b, 4)):
                    runs = prepare(H, W, bias, keys, noise, ent, pp, seed)
                    for l, _ in runs:
                        l()
                    torch.cuda.synchronize()
                    same = all(torch.equal(x.view(torch.int32), y.view(torch.int32))
                               for x, y in zip(runs[0][1], runs[1][1]))
                    check(f"sample pass = old {dt} {logits} N={N} D={D} V={V} noise={noise} ent={ent} pp={pp} "
                          f"bias={bias is not None}", same)
    W = {"flat": rnd(128256, 4096, scale=0.002), "peaked": rnd(128256, 4096, scale=0.5)}
    for N in (int(n) for n in (arg("--rows") or "64,4096").split(",")):
        H = rnd(N, 4096)
        keys = torch.arange(N, device="cuda", dtype=torch.int32)
        for logits, w in W.items():
            t_cb = bench(lambda: torch.matmul(H, w.t()))
            for noise, rule in ((1, "gumbel"), (0, "greedy")):
                (new, _), (old, _) = prepare(H, w, None, keys, noise, False, N <= 4096, 1)
                t_new, t_old = bench_pair(new, old)
                print(f"RESULT sample pass {rule} {logits} N={N}: new {t_new:.4f} ms, old {t_old:.4f} ms, cuBLAS GEMM "
                      f"{t_cb:.4f} ms; new/GEMM {t_new / t_cb:.3f}, old/GEMM {t_old / t_cb:.3f}", flush=True)


def sample_pingpong():
    """The sampler's pass with ping-pong consumers against the 128-row one: same tokens and log-probs, bitwise,
    then both timed (Gumbel and greedy) beside one cuBLAS GEMM, at the rows of --rows."""
    print("\n== linear_sample pass: ping-pong vs plain vs cuBLAS (bf16, D 4096, V 128256) ==", flush=True)
    W = rnd(128256, 4096, scale=0.5)
    for N in (int(n) for n in (arg("--rows") or "64,4096").split(",")):
        H = rnd(N, 4096)
        keys = torch.arange(N, device="cuda", dtype=torch.int32)
        t_cb = bench(lambda: torch.matmul(H, W.t()))
        for noise, rule in ((1, "gumbel"), (0, "greedy")):
            same = all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in
                       zip(sample_pass(H, W, keys, noise), sample_pass(H, W, keys, noise, pp=True)))
            check(f"sample pp = plain {rule} N={N}", same)
            plain = runner(record(lambda: sample_pass(H, W, keys, noise)))
            pp = runner(record(lambda: sample_pass(H, W, keys, noise, pp=True)))
            t_plain, t_pp = bench_pair(plain, pp)
            print(f"RESULT sample {rule} N={N}: plain {t_plain:.4f} ms, ping-pong {t_pp:.4f} ms, cuBLAS GEMM "
                  f"{t_cb:.4f} ms; plain/GEMM {t_plain / t_cb:.3f}, pp/GEMM {t_pp / t_cb:.3f}", flush=True)


def perf():
    dt = torch.bfloat16
    print("\n== GEMM bf16 M=4096 (NN forward) ==", flush=True)
    for (K, N) in ((4096, 12288), (4096, 4096), (4096, 14336), (14336, 4096), (4096, 32000)):
        M = 4096
        A = rnd(M, K); B = rnd(K, N); out = torch.empty(M, N, dtype=dt, device="cuda")
        t_ours, t_cb = bench_pair(runner(record(lambda: gemm("nn", A, B, out=out))), lambda: torch.matmul(A, B))
        fl = 2 * M * N * K
        PERF.append(("gemm nn", f"M={M} K={K} N={N}", t_ours, t_cb, fl))
        # backward: dLhs = dO . B^T (NT), dRhs = A^T . dO (TN)
        dO = rnd(M, N); Bt = B  # B[K,N] is the NT right operand viewed as [N', K'] = [K, N]
        t_b, t_bc = bench_pair(runner(record(lambda: (gemm("nt", dO, Bt), gemm("tn", A, dO)))),
                               lambda: (torch.matmul(dO, B.t()), torch.matmul(A.t(), dO)))
        PERF.append(("gemm bwd nt+tn", f"M={M} K={K} N={N}", t_b, t_bc, 2 * fl))
    print("== decode (small variant) ==", flush=True)
    for (K, N) in ((4096, 12288), (4096, 4096), (4096, 14336), (14336, 4096), (4096, 32000)):
        B = rnd(K, N)
        for M in (1, 16, 64):
            A = rnd(M, K); out = torch.empty(M, N, dtype=dt, device="cuda")
            t_ours, t_cb = bench_pair(runner(record(lambda: gemm("nn", A, B, out=out, variant="small"))),
                                      lambda: torch.matmul(A, B))
            PERF.append(("gemm nn small", f"M={M} K={K} N={N}", t_ours, t_cb, 2 * M * N * K))
    print("== linear_logp N=4096 D=2048 ==", flush=True)
    N, D = 4096, 2048
    dz = torch.empty((TOKEN_CHUNK, VOCAB_CHUNK), dtype=dt, device="cuda")
    part = torch.empty((TOKEN_CHUNK // DZ.rows, VOCAB_CHUNK), device="cuda")
    for V in (32768, 50257, 131072):
        H = rnd(N, D); W = rnd(V, D, scale=0.05); tg = torch.randint(0, V, (N,), device="cuda", dtype=torch.int32)
        Vr = -(-V // 128) * 128
        Wg = rnd(D, Vr)
        t_f, t_g = bench_pair(runner(record(lambda: logp_fwd(H, W, tg))), lambda: torch.matmul(H, Wg))
        lp, lse = logp_fwd(H, W, tg)
        gl = torch.randn(N, device="cuda"); gs = torch.randn(N, device="cuda") * 0.3
        t_fb, t_g4 = bench_pair(runner(record(lambda: (logp_fwd(H, W, tg), logp_bwd(H, W, tg, lse, gl, gs, ws=(dz, part))))),
                                lambda: [torch.matmul(H, Wg) for _ in range(4)], rounds=3, iters=3)
        PERF.append(("logp fwd", f"N={N} D={D} V={V}", t_f, t_g, 2 * N * D * V))
        PERF.append(("logp fwd+bwd", f"N={N} D={D} V={V} (vs 4 GEMMs)", t_fb, t_g4, 8 * N * D * V))
        del W, Wg
    print("\n| case | shape | ours ms | TFLOP/s | cuBLAS ms | cuBLAS TFLOP/s | ours/cuBLAS time |")
    print("|---|---|---|---|---|---|---|")
    for (k, s, t, tc, fl) in PERF:
        print(f"| {k} | {s} | {t:.4f} | {fl/t/1e9:.0f} | {tc:.4f} | {fl/tc/1e9:.0f} | {t/tc:.3f} |", flush=True)


def prof():
    """One launch of each kernel worth profiling (run under ncu)."""
    A = rnd(4096, 4096); B = rnd(4096, 12288)
    gemm("nn", A, B); torch.matmul(A, B)
    B = rnd(4096, 4096)
    a1 = rnd(1, 4096)
    gemm("nn", a1, B, variant="small"); torch.matmul(a1, B)
    H = rnd(4096, 2048); W = rnd(32768, 2048, scale=0.05); tg = torch.randint(0, 32768, (4096,), device="cuda", dtype=torch.int32)
    lp, lse = logp_fwd(H, W, tg)
    logp_bwd(H, W, tg, lse, torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda"), vchunk=8192)
    torch.cuda.synchronize()


def attn_prof():
    """One attention forward of each kind worth profiling (run under ncu): ours and SDPA's cuDNN kernel at B 8 ·
    32/8 heads · S 2048 · Dh 128, causal, and ours at B 4 · S 4096 · Dh 64 (the three-warpgroup forward)."""
    for (B, S, D) in ((8, 2048, 128), (4, 4096, 64)):
        q = rnd(B, 32, S, D); k = rnd(B, 8, S, D); v = rnd(B, 8, S, D)
        attn_fwd(q, k, v, None, True, kind=attn_kind(B, 32, 8, S, S, D))
        fn = sdpa_fn(q, k, v, True, "cudnn")
        if fn is not None:
            fn()
    torch.cuda.synchronize()


def perf_bwd_split():
    """NT and TN separately, each against the same cuBLAS product."""
    print("\n| part | shape | ours ms | cuBLAS ms | ours/cuBLAS time |\n|---|---|---|---|---|")
    for (K, N) in ((4096, 12288), (4096, 4096), (4096, 14336), (14336, 4096), (4096, 32000)):
        M = 4096
        A = rnd(M, K); B = rnd(K, N); dO = rnd(M, N)
        for part, ours, ref in (("nt dLhs", lambda: gemm("nt", dO, B), lambda: torch.matmul(dO, B.t())),
                                ("tn dRhs", lambda: gemm("tn", A, dO), lambda: torch.matmul(A.t(), dO))):
            t = bench(runner(record(ours))); tc = bench(ref)
            print(f"| {part} | M={M} K={K} N={N} | {t:.4f} | {tc:.4f} | {t/tc:.3f} |", flush=True)
    N, D, V = 4096, 2048, 32768
    H = rnd(N, D); W = rnd(V, D, scale=0.05); tg = torch.randint(0, V, (N,), device="cuda", dtype=torch.int32)
    lp, lse = logp_fwd(H, W, tg)
    gl = torch.randn(N, device="cuda"); gs = torch.randn(N, device="cuda") * 0.3
    L = record(lambda: logp_bwd(H, W, tg, lse, gl, gs))
    names = {}
    for l in L:
        names.setdefault(id(l.f), []).append(l)
    Wg = rnd(D, 8192)
    tc = bench(lambda: torch.matmul(H, Wg))
    for k, ls in names.items():
        t = bench(runner(ls))
        print(f"| logp bwd part (x{len(ls)} launches, grid {ls[0].grid}) | N={N} D={D} V={V} | {t:.4f} | {tc*len(ls):.4f} | {t/(tc*len(ls)):.3f} |", flush=True)


def ksweep():
    """Per-tile fixed cost: time vs K at fixed M=N=4096 (512 tiles), with and without epilogue stores."""
    print("\n| variant | K | ms | us per tile-round | stores off ms | cuBLAS ms |\n|---|---|---|---|---|---|")
    for v in ("big",):
        for K in (64, 512, 1024, 2048, 4096, 8192):
            A = rnd(4096, K); B = rnd(K, 4096); out = torch.empty(4096, 4096, dtype=torch.bfloat16, device="cuda")
            t = bench(runner(record(lambda: gemm("nn", A, B, out=out, variant=v))))
            t0 = bench(runner(record(lambda: gemm("nn", A, B, out=out, variant=v, flags=0))))
            tc = bench(lambda: torch.matmul(A, B))
            print(f"| {v} | {K} | {t:.4f} | {t*1000/4:.2f} | {t0:.4f} | {tc:.4f} |", flush=True)


def sanitize():
    """Small shapes through every entry point, for compute-sanitizer (memcheck / racecheck)."""
    torch.manual_seed(3)
    for dt in (torch.bfloat16, torch.float16):
        for (M, K, N) in ((7, 136, 264), (129, 72, 1000)):
            A = rnd(M, K, dt=dt); B = rnd(K, N, dt=dt); bias = rnd(N, dt=dt)
            for v in ("big", "small"):
                gemm("nn", A, B, bias, variant=v); gemm("nt", A, B.t().contiguous(), bias, variant=v)
            for v in ("big",):
                gemm("tn", rnd(K, 136, dt=dt), B, bias, variant=v)
        N, D, V = 129, 136, 1300
        H = rnd(N, D, dt=dt); W = rnd(V, D, dt=dt); b = rnd(V, dt=dt)
        tg = torch.randint(0, V, (N,), device="cuda", dtype=torch.int32); tg[0] = -100; tg[1] = V + 3
        lp, lse = logp_fwd(H, W, tg, b, -100)
        logp_bwd(H, W, tg, lse, torch.randn(N, device="cuda"), torch.randn(N, device="cuda"), b, -100, tchunk=128, vchunk=512)
        keys = torch.arange(N, device="cuda", dtype=torch.int32)
        for noise in (0, 1):
            for pp in (False, True):
                sample_pass(H, W, keys, noise, pp)
        for D in (64, 128):
            q = rnd(2, 8, 37, D, dt=dt); k = rnd(2, 2, 150, D, dt=dt); v = rnd(2, 2, 150, D, dt=dt)
            for causal in (True, False):
                out, lse = attn_fwd(q, k, v, _lens([150, 20]), causal)
                attn_bwd(q, k, v, out, lse, rnd(2, 8, 37, D, dt=dt), _lens([150, 20]), causal)
                attn_fwd(q[:, :, :1].contiguous(), k, v, _lens([149, 0]), causal)
                for kind in ("split_", "part_") + (("wide_",) if D == 64 else ()):
                    attn_fwd(q, k, v, _lens([150, 20]), causal, kind=kind)
        for D in (64, 128):
            q = rnd(1, 4, 3, D, dt=dt); k = rnd(1, 1, 4200, D, dt=dt); v = rnd(1, 1, 4200, D, dt=dt)
            for kind in ("split_", "part_"):
                attn_fwd(q, k, v, _lens([4150]), True, kind=kind)
    torch.cuda.synchronize()
    print("[PASS] sanitize workload ran", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(0), "SMs", NUM_SMS, "torch", torch.__version__, flush=True)
    if "sanitize" in ONLY:
        sanitize()
    if "attnprof" in ONLY:
        attn_prof()
    if "prof" in ONLY:
        prof()
    if "gemm" in ONLY:
        test_gemm()
    if "logp" in ONLY:
        test_logp()
    if "perf" in ONLY:
        perf()
    if "logppp" in ONLY:
        logp_pingpong()
    if "samplepp" in ONLY:
        sample_pingpong()
    if "samplepass" in ONLY:
        sample_pass_vs_old()
    if "samplemerge" in ONLY:
        sample_merge()
    if "ksweep" in ONLY:
        ksweep()
    if "perfbwd" in ONLY:
        perf_bwd_split()
    if "attn" in ONLY:
        test_attn()
    if "attnperf" in ONLY:
        attn_perf()
    if "attnsplit" in ONLY:
        test_attn_split()
    if "attnlong" in ONLY:
        attn_long_perf()
    if "attnbwd" in ONLY:
        test_attn_bwd()
    if "attnbwdperf" in ONLY:
        attn_bwd_perf()
    torch.cuda.synchronize()
    nf = sum(1 for _, ok in RESULTS if not ok)
    print(f"SUMMARY: {len(RESULTS) - nf} PASS, {nf} FAIL", flush=True)
    sys.exit(1 if nf else 0)
