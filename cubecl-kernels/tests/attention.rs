//! Attention forward/backward tests (wgpu; skipped with a notice where no adapter exists).
//!
//! Values against an f64 softmax attention; bitwise invariances (decode = prefill, batch rows,
//! chunked prefill, ragged `kv_lens` with garbage, reruns, padding rows in the backward, strided
//! layouts); and, for f32 / f16, bitwise equality with `mirror`, a private f32 copy of the
//! Reference (`src/ops/attention/oracle.rs`, `src/ops/math.rs`): this crate cannot depend on
//! the main crate, and without it nothing here would check the contract's bits.

mod common;

use burn_invariant_cubecl::FloatDType;
use burn_invariant_cubecl::KernelError;
use burn_invariant_cubecl::attention::*;
use common::*;
use cubecl::prelude::*;

#[derive(Clone)]
struct Problem {
    b: usize,
    h: usize,
    kh: usize,
    q: usize,
    kv: usize,
    d: usize,
    causal: bool,
    scale: f32,
    dt: Dt,
    query: Vec<f32>,
    key: Vec<f32>,
    value: Vec<f32>,
    lens: Vec<i32>,
}

impl Problem {
    #[allow(clippy::too_many_arguments)]
    fn new(
        seed: u64,
        b: usize,
        h: usize,
        kh: usize,
        q: usize,
        kv: usize,
        d: usize,
        causal: bool,
        dt: Dt,
    ) -> Self {
        let query = rand_vec(seed, b * h * q * d, dt)
            .iter()
            .map(|x| dt.round(2.0 * x))
            .collect();
        Problem {
            b,
            h,
            kh,
            q,
            kv,
            d,
            causal,
            scale: 1.0 / (d.max(1) as f32).sqrt(),
            dt,
            query,
            key: rand_vec(seed + 1, b * kh * kv * d, dt),
            value: rand_vec(seed + 2, b * kh * kv * d, dt),
            lens: vec![kv as i32; b],
        }
    }

    fn with_lens(mut self, lens: &[i32]) -> Self {
        self.lens = lens.to_vec();
        self
    }

    fn q_at(&self, b: usize, h: usize, i: usize) -> usize {
        ((b * self.h + h) * self.q + i) * self.d
    }

    fn kv_at(&self, b: usize, kh: usize, j: usize) -> usize {
        ((b * self.kh + kh) * self.kv + j) * self.d
    }

    fn visible(&self, b: usize, i: usize) -> Option<usize> {
        let len = self.lens[b].clamp(0, self.kv as i32) as i64;
        let pos = len - self.q as i64 + i as i64;
        if pos < 0 {
            None
        } else if self.causal {
            Some(pos as usize + 1)
        } else {
            Some(len as usize)
        }
    }

    fn kv_head(&self, h: usize) -> usize {
        h / (self.h / self.kh)
    }

    fn dims(&self) -> AttentionDims {
        AttentionDims {
            batch: self.b,
            heads: self.h,
            kv_heads: self.kh,
            q_len: self.q,
            kv_len: self.kv,
            head_dim: self.d,
        }
    }

    /// Keys and values past each row's length replaced by NaN (what a kernel must never read).
    fn poison_past_lens(&mut self) {
        for b in 0..self.b {
            for kh in 0..self.kh {
                for j in self.lens[b].max(0) as usize..self.kv {
                    let at = self.kv_at(b, kh, j);
                    for x in 0..self.d {
                        self.key[at + x] = f32::NAN;
                        self.value[at + x] = f32::NAN;
                    }
                }
            }
        }
    }
}

fn float_dtype(dt: Dt) -> FloatDType {
    match dt {
        Dt::F32 => FloatDType::F32,
        Dt::F16 => FloatDType::F16,
        Dt::BF16 => FloatDType::BF16,
    }
}

#[derive(Clone, Debug, PartialEq)]
struct Fwd {
    out: Vec<f32>,
    lse: Vec<f32>,
}

#[derive(Clone, Debug, PartialEq)]
struct Grads {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

struct Dev<R: Runtime> {
    q: Buf<R>,
    k: Buf<R>,
    v: Buf<R>,
    lens: Buf<R>,
}

fn upload_problem<R: Runtime>(client: &ComputeClient<R>, p: &Problem) -> Dev<R> {
    Dev {
        q: upload(client, &p.query, &[p.b, p.h, p.q, p.d], p.dt),
        k: upload(client, &p.key, &[p.b, p.kh, p.kv, p.d], p.dt),
        v: upload(client, &p.value, &[p.b, p.kh, p.kv, p.d], p.dt),
        lens: upload_i32(client, &p.lens),
    }
}

fn refs<'a, R: Runtime>(dev: &'a Dev<R>, p: &Problem) -> AttentionRefs<'a, R> {
    AttentionRefs {
        query: dev.q.b(),
        key: dev.k.b(),
        value: dev.v.b(),
        kv_lens: dev.lens.b(),
        dtype: float_dtype(p.dt),
        causal: p.causal,
        scale: p.scale,
    }
}

fn forward_dev<R: Runtime>(
    client: &ComputeClient<R>,
    p: &Problem,
    dev: &Dev<R>,
    execution: SplitExecution,
) -> (Fwd, Buf<R>, Buf<R>) {
    let out = alloc_dense(client, &[p.b, p.h, p.q, p.d], p.dt);
    let lse = alloc_dense(client, &[p.b, p.h, p.q], Dt::F32);
    attention_forward_with(client, &refs(dev, p), out.b(), lse.b(), execution).expect("forward");
    let n = p.b * p.h * p.q;
    let mut o = read_raw(client, &out, p.dt);
    o.truncate(n * p.d);
    let mut l = read_raw(client, &lse, Dt::F32);
    l.truncate(n);
    (Fwd { out: o, lse: l }, out, lse)
}

fn forward<R: Runtime>(client: &ComputeClient<R>, p: &Problem) -> Fwd {
    forward_with(client, p, SplitExecution::Auto)
}

fn forward_with<R: Runtime>(client: &ComputeClient<R>, p: &Problem, ex: SplitExecution) -> Fwd {
    forward_dev(client, p, &upload_problem(client, p), ex).0
}

fn backward<R: Runtime>(client: &ComputeClient<R>, p: &Problem, grad: &[f32]) -> (Fwd, Grads) {
    let dev = upload_problem(client, p);
    let (fwd, out, lse) = forward_dev(client, p, &dev, SplitExecution::Auto);
    let go = upload(client, grad, &[p.b, p.h, p.q, p.d], p.dt);
    let dq = alloc_dense(client, &[p.b, p.h, p.q, p.d], p.dt);
    let dk = alloc_dense(client, &[p.b, p.kh, p.kv, p.d], p.dt);
    let dv = alloc_dense(client, &[p.b, p.kh, p.kv, p.d], p.dt);
    let ws = alloc_dense(
        client,
        &[attention_backward_workspace_len(p.b, p.h, p.q)],
        Dt::F32,
    );
    let grads = AttentionGradRefs {
        out: out.b(),
        lse: lse.b(),
        grad_out: go.b(),
        grad_query: dq.b(),
        grad_key: dk.b(),
        grad_value: dv.b(),
        workspace: ws.b(),
    };
    attention_backward(client, &refs(&dev, p), &grads).expect("backward");
    let read = |buf: &Buf<R>, n: usize| {
        let mut x = read_raw(client, buf, p.dt);
        x.truncate(n);
        x
    };
    let nq = p.b * p.h * p.q * p.d;
    let nk = p.b * p.kh * p.kv * p.d;
    let g = Grads {
        dq: read(&dq, nq),
        dk: read(&dk, nk),
        dv: read(&dv, nk),
    };
    (fwd, g)
}

/// Upstream gradient: random, with the rows `i % 5 == 3` all zero.
fn grad_for(p: &Problem, seed: u64) -> Vec<f32> {
    let mut g = rand_vec(seed, p.b * p.h * p.q * p.d, p.dt);
    for row in 0..p.b * p.h * p.q {
        if row % 5 == 3 {
            g[row * p.d..(row + 1) * p.d].fill(0.0);
        }
    }
    g
}

fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for i in 0..got.len() {
        let same = got[i].to_bits() == want[i].to_bits() || (got[i].is_nan() && want[i].is_nan());
        assert!(
            same,
            "{what}: element {i}: got {:e} ({:#010x}) want {:e} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

/// `|got − want| ≤ rtol · max|want|` element-wise (and the same non-finite values).
fn assert_close(what: &str, got: &[f32], want: &[f64], rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want
        .iter()
        .filter(|x| x.is_finite())
        .fold(1e-30f64, |m, x| m.max(x.abs()));
    for i in 0..got.len() {
        if !want[i].is_finite() {
            assert_eq!(got[i] as f64, want[i], "{what}: element {i}");
            continue;
        }
        let err = (got[i] as f64 - want[i]).abs();
        assert!(
            err <= rtol * scale,
            "{what}: element {i}: got {} want {} (err {err:e}, max {scale:e})",
            got[i],
            want[i]
        );
    }
}

fn rtol(dt: Dt) -> f64 {
    match dt {
        Dt::F32 => 2e-5,
        Dt::F16 => 4e-3,
        Dt::BF16 => 8e-3,
    }
}

// ---------------------------------------------------------------------------------------------
// f64 softmax attention and its analytic gradients.

fn reference_f64(p: &Problem) -> (Vec<f64>, Vec<f64>) {
    let (d, rows) = (p.d, p.b * p.h * p.q);
    let mut out = vec![0.0f64; rows * d];
    let mut lse = vec![f64::NEG_INFINITY; rows];
    for b in 0..p.b {
        for h in 0..p.h {
            for i in 0..p.q {
                let row = (b * p.h + h) * p.q + i;
                let Some(n) = p.visible(b, i) else { continue };
                let qa = p.q_at(b, h, i);
                let s: Vec<f64> = (0..n)
                    .map(|j| {
                        let ka = p.kv_at(b, p.kv_head(h), j);
                        (0..d)
                            .map(|x| p.query[qa + x] as f64 * p.scale as f64 * p.key[ka + x] as f64)
                            .sum()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                lse[row] = m + z.ln();
                for (j, sj) in s.iter().enumerate() {
                    let pj = (sj - m).exp() / z;
                    let va = p.kv_at(b, p.kv_head(h), j);
                    for x in 0..d {
                        out[row * d + x] += pj * p.value[va + x] as f64;
                    }
                }
            }
        }
    }
    (out, lse)
}

fn reference_grads_f64(p: &Problem, g: &[f32]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let d = p.d;
    let sc = p.scale as f64;
    let mut dq = vec![0.0f64; p.query.len()];
    let mut dk = vec![0.0f64; p.key.len()];
    let mut dv = vec![0.0f64; p.value.len()];
    for b in 0..p.b {
        for h in 0..p.h {
            let kh = p.kv_head(h);
            for i in 0..p.q {
                let row = (b * p.h + h) * p.q + i;
                let Some(n) = p.visible(b, i) else { continue };
                let qa = p.q_at(b, h, i);
                let gr = &g[row * d..(row + 1) * d];
                let s: Vec<f64> = (0..n)
                    .map(|j| {
                        (0..d)
                            .map(|x| {
                                p.query[qa + x] as f64 * sc * p.key[p.kv_at(b, kh, j) + x] as f64
                            })
                            .sum()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                let pr: Vec<f64> = s.iter().map(|x| (x - m).exp() / z).collect();
                let dp: Vec<f64> = (0..n)
                    .map(|j| {
                        (0..d)
                            .map(|x| gr[x] as f64 * p.value[p.kv_at(b, kh, j) + x] as f64)
                            .sum()
                    })
                    .collect();
                let delta: f64 = (0..n).map(|j| pr[j] * dp[j]).sum();
                for j in 0..n {
                    let ds = pr[j] * (dp[j] - delta);
                    let ka = p.kv_at(b, kh, j);
                    for x in 0..d {
                        dq[qa + x] += ds * p.key[ka + x] as f64 * sc;
                        dk[ka + x] += ds * p.query[qa + x] as f64 * sc;
                        dv[ka + x] += pr[j] * gr[x] as f64;
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}

// ---------------------------------------------------------------------------------------------
// `mirror`: the Reference's f32 arithmetic (oracle.rs / math.rs), operation for operation.

mod mirror {
    use super::Problem;
    use burn_invariant_cubecl::attention::ATTENTION_KEY_SPLIT as KEY_SPLIT;
    use std::ops::Range;

    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
    const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
    const EXP_TAYLOR: [f32; 8] = [
        1.0,
        1.0,
        0.5,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5040.0,
    ];

    const fn pow2(n: i32) -> f32 {
        f32::from_bits(((n + 127) as u32) << 23)
    }

    pub fn exp_p(x: f32) -> f32 {
        if x < -86.0 {
            return 0.0;
        }
        if x > 88.0 {
            return f32::INFINITY;
        }
        if x.is_nan() {
            return x;
        }
        let n = x.mul_add(LOG2E, 0.5).floor();
        let r = (-n).mul_add(LN2_HI, x);
        let r = (-n).mul_add(LN2_LO, r);
        let mut p = EXP_TAYLOR[7];
        for k in (0..7).rev() {
            p = p.mul_add(r, EXP_TAYLOR[k]);
        }
        p * pow2(n as i32)
    }

    const STEPS: [(i32, f32, f32); 7] = [
        (64, pow2(64), pow2(-64)),
        (32, pow2(32), pow2(-32)),
        (16, pow2(16), pow2(-16)),
        (8, pow2(8), pow2(-8)),
        (4, pow2(4), pow2(-4)),
        (2, pow2(2), pow2(-2)),
        (1, pow2(1), pow2(-1)),
    ];

    pub fn ln_p(x: f32) -> f32 {
        let (mut f, mut e) = (x, 0i32);
        for (k, up, down) in STEPS {
            if f >= up {
                f *= down;
                e += k;
            }
        }
        for (k, up, down) in STEPS {
            if f < down * 2.0 {
                f *= up;
                e -= k;
            }
        }
        if f > std::f32::consts::SQRT_2 {
            f *= 0.5;
            e += 1;
        }
        let u = f - 1.0;
        let c = |k: usize| {
            let c = 1.0 / k as f32;
            if k.is_multiple_of(2) { -c } else { c }
        };
        let mut q = c(17);
        for k in (1..17).rev() {
            q = q.mul_add(u, c(k));
        }
        let ef = e as f32;
        ef.mul_add(LN2_HI, ef.mul_add(LN2_LO, u * q))
    }

    fn dot(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .fold(0.0f32, |acc, (&x, &y)| x.mul_add(y, acc))
    }

    fn scaled(q: &[f32], scale: f32) -> Vec<f32> {
        q.iter().map(|&x| x * scale).collect()
    }

    fn forward_row(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        visible: usize,
        scale: f32,
        out: &mut [f32],
    ) -> f32 {
        let d = q.len();
        let q = scaled(q, scale);
        let mut run: Option<(f32, f32, Vec<f32>)> = None;
        for s0 in (0..visible).step_by(KEY_SPLIT) {
            let (m, l, o) = split_state(&q, k, v, s0..visible.min(s0 + KEY_SPLIT));
            run = Some(match run {
                None => (m, l, o),
                Some((rm, rl, mut ro)) => {
                    let (mx, a, b) = fold_weights(rm, m);
                    for (acc, &x) in ro.iter_mut().zip(&o) {
                        *acc = acc.mul_add(a, x * b);
                    }
                    (mx, rl.mul_add(a, l * b), ro)
                }
            });
        }
        let (m, l, o) = run.unwrap_or((f32::NEG_INFINITY, 0.0, vec![0.0; d]));
        for (dst, &acc) in out.iter_mut().zip(&o) {
            *dst = acc / l;
        }
        m + ln_p(l)
    }

    /// `(m, l, o)` of the keys `keys` (one split) in blocks of 64 from its first key.
    fn split_state(q: &[f32], k: &[f32], v: &[f32], keys: Range<usize>) -> (f32, f32, Vec<f32>) {
        let d = q.len();
        let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
        let mut o = vec![0.0f32; d];
        let mut o_b = vec![0.0f32; d];
        let mut s = [0.0f32; 64];
        for start in keys.clone().step_by(64) {
            let block = start..keys.end.min(start + 64);
            let mut m_new = m;
            for (t, j) in block.clone().enumerate() {
                s[t] = dot(q, &k[j * d..(j + 1) * d]);
                m_new = m_new.max(s[t]);
            }
            let alpha = exp_p(m - m_new);
            let mut l_b = 0.0f32;
            o_b.fill(0.0);
            for (t, j) in block.enumerate() {
                let p = exp_p(s[t] - m_new);
                l_b += p;
                for (acc, &vj) in o_b.iter_mut().zip(&v[j * d..(j + 1) * d]) {
                    *acc = p.mul_add(vj, *acc);
                }
            }
            l = l.mul_add(alpha, l_b);
            for (acc, &b) in o.iter_mut().zip(&o_b) {
                *acc = acc.mul_add(alpha, b);
            }
            m = m_new;
        }
        (m, l, o)
    }

    /// `(M, a, b)` folding a split with max `m_s` into the running state with max `m`: `M` the
    /// larger, `a = exp_p(m − M)`, `b = exp_p(m_s − M)`, exactly 1 on the side holding `M`.
    fn fold_weights(m: f32, m_s: f32) -> (f32, f32, f32) {
        let mx = if m_s > m { m_s } else { m };
        let a = if m == mx { 1.0 } else { exp_p(m - mx) };
        let b = if m_s == mx { 1.0 } else { exp_p(m_s - mx) };
        (mx, a, b)
    }

    /// `(out, lse)`, `out` rounded to the dtype.
    pub fn forward(p: &Problem) -> (Vec<f32>, Vec<f32>) {
        let d = p.d;
        let rows = p.b * p.h * p.q;
        let mut out = vec![0.0f32; rows * d];
        let mut lse = vec![f32::NEG_INFINITY; rows];
        for row in 0..rows {
            let (bh, i) = (row / p.q, row % p.q);
            let (b, h) = (bh / p.h, bh % p.h);
            let Some(visible) = p.visible(b, i) else {
                continue;
            };
            let kv = p.kv_at(b, p.kv_head(h), 0);
            let span = kv..kv + p.kv * d;
            let q = &p.query[p.q_at(b, h, i)..][..d];
            lse[row] = forward_row(
                q,
                &p.key[span.clone()],
                &p.value[span],
                visible,
                p.scale,
                &mut out[row * d..(row + 1) * d],
            );
        }
        (out.iter().map(|&x| p.dt.round(x)).collect(), lse)
    }

    fn pair(q_scaled: &[f32], k: &[f32], v: &[f32], g: &[f32], lse: f32, delta: f32) -> (f32, f32) {
        let p = exp_p(dot(q_scaled, k) - lse);
        let dp = dot(g, v);
        (p, p * (dp - delta))
    }

    /// `(dq, dk, dv)` rounded to the dtype, from the device's `out` and `lse`.
    pub fn backward(
        p: &Problem,
        out: &[f32],
        lse: &[f32],
        grad: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let d = p.d;
        let active: Vec<Option<(usize, f32)>> = (0..p.b * p.h * p.q)
            .map(|row| {
                let (bh, i) = (row / p.q, row % p.q);
                let visible = p.visible(bh / p.h, i)?;
                let g = &grad[row * d..][..d];
                if g.iter().all(|&x| x == 0.0) {
                    return None;
                }
                Some((visible, dot(g, &out[row * d..][..d])))
            })
            .collect();
        let mut dq = vec![0.0f32; p.query.len()];
        for row in 0..p.b * p.h * p.q {
            let Some((visible, delta)) = active[row] else {
                continue;
            };
            let (bh, i) = (row / p.q, row % p.q);
            let (b, h) = (bh / p.h, bh % p.h);
            let q = scaled(&p.query[p.q_at(b, h, i)..][..d], p.scale);
            let g = &grad[row * d..][..d];
            let dq = &mut dq[row * d..(row + 1) * d];
            for j in 0..visible {
                let at = p.kv_at(b, p.kv_head(h), j);
                let (_, ds) = pair(
                    &q,
                    &p.key[at..at + d],
                    &p.value[at..at + d],
                    g,
                    lse[row],
                    delta,
                );
                for (acc, &kj) in dq.iter_mut().zip(&p.key[at..at + d]) {
                    *acc = ds.mul_add(kj, *acc);
                }
            }
            dq.iter_mut().for_each(|x| *x *= p.scale);
        }
        let mut dk = vec![0.0f32; p.key.len()];
        let mut dv = vec![0.0f32; p.value.len()];
        let group = p.h / p.kh;
        for krow in 0..p.b * p.kh * p.kv {
            let (bkh, j) = (krow / p.kv, krow % p.kv);
            let (b, kh) = (bkh / p.kh, bkh % p.kh);
            let (k, v) = (&p.key[krow * d..][..d], &p.value[krow * d..][..d]);
            for h in kh * group..(kh + 1) * group {
                for i in 0..p.q {
                    let row = (b * p.h + h) * p.q + i;
                    let Some((visible, delta)) = active[row] else {
                        continue;
                    };
                    if j >= visible {
                        continue;
                    }
                    let q = scaled(&p.query[p.q_at(b, h, i)..][..d], p.scale);
                    let g = &grad[row * d..][..d];
                    let (pr, ds) = pair(&q, k, v, g, lse[row], delta);
                    for t in 0..d {
                        dv[krow * d + t] = pr.mul_add(g[t], dv[krow * d + t]);
                        dk[krow * d + t] = ds.mul_add(q[t], dk[krow * d + t]);
                    }
                }
            }
        }
        let r = |x: Vec<f32>| x.iter().map(|&v| p.dt.round(v)).collect::<Vec<_>>();
        (r(dq), r(dk), r(dv))
    }
}

// ---------------------------------------------------------------------------------------------

fn math_matches_reference_bitwise_on<R: Runtime>(client: &ComputeClient<R>) {
    let mut xs: Vec<f32> = (0..20_000)
        .map(|i| -92.0 + 184.0 * (i as f32 / 20_000.0))
        .collect();
    xs.extend(rand_vec(7, 4000, Dt::F32).iter().map(|x| x * 1e-3));
    xs.extend((0..3000).map(|i| 1.0 + i as f32 * 0.37));
    // Every exponent of a normal float, for the range of `div_rn` and `sqrt_rn`.
    xs.extend((0..4000u32).map(|i| {
        let x = f32::from_bits(((i % 254 + 1) << 23) | (i.wrapping_mul(2_654_435_761) >> 9));
        if i % 3 == 0 { -x } else { x }
    }));
    xs.extend([
        0.0,
        -0.0,
        1.0,
        64.0,
        1e-30,
        1e30,
        3.4e38,
        -86.0,
        88.0,
        -86.000_01,
        88.000_01,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ]);
    let got = attention_math_on_device(client, &xs).expect("probe");
    let n = xs.len();
    let want_exp: Vec<f32> = xs.iter().map(|&x| mirror::exp_p(x)).collect();
    let want_ln: Vec<f32> = xs.iter().map(|&x| mirror::ln_p(x)).collect();
    assert_bits("exp_p", &got[..n], &want_exp);
    // ln_p of x ≥ 1 (what attention takes it of) and of other positive normal values.
    let pos: Vec<usize> = (0..n)
        .filter(|&i| xs[i] > 1e-30 && xs[i].is_finite())
        .collect();
    let g: Vec<f32> = pos.iter().map(|&i| got[n + i]).collect();
    let w: Vec<f32> = pos.iter().map(|&i| want_ln[i]).collect();
    assert_bits("ln_p", &g, &w);
    // IEEE division and root whatever the device's own (Vulkan allows 2.5 ulps), on normal
    // operands and results.
    let normal = |v: f32| v.is_normal();
    let div: Vec<usize> = (0..n)
        .filter(|&i| {
            let (a, b) = (xs[i], xs[(i + 1) % n]);
            normal(a) && normal(b) && normal(a / b)
        })
        .collect();
    let g: Vec<f32> = div.iter().map(|&i| got[2 * n + i]).collect();
    let w: Vec<f32> = div.iter().map(|&i| xs[i] / xs[(i + 1) % n]).collect();
    assert_bits("div_rn", &g, &w);
    let root: Vec<usize> = (0..n).filter(|&i| normal(xs[i])).collect();
    let g: Vec<f32> = root.iter().map(|&i| got[3 * n + i]).collect();
    let w: Vec<f32> = root.iter().map(|&i| xs[i].abs().sqrt()).collect();
    assert_bits("sqrt_rn", &g, &w);
    let recip: Vec<usize> = (0..n)
        .filter(|&i| normal(xs[i]) && normal(1.0 / xs[i]))
        .collect();
    let g: Vec<f32> = recip.iter().map(|&i| got[4 * n + i]).collect();
    let w: Vec<f32> = recip.iter().map(|&i| 1.0 / xs[i]).collect();
    assert_bits("recip_rn", &g, &w);
}

#[test]
fn math_matches_reference_bitwise() {
    with_wgpu("math_matches_reference_bitwise", |client| {
        math_matches_reference_bitwise_on(client)
    });
}

fn check_forward<R: Runtime>(client: &ComputeClient<R>, p: &Problem, what: &str) -> Fwd {
    let got = forward(client, p);
    let (out, lse) = reference_f64(p);
    assert_close(&format!("{what} out"), &got.out, &out, rtol(p.dt));
    assert_close(&format!("{what} lse"), &got.lse, &lse, rtol(p.dt));
    let (mo, ml) = mirror::forward(p);
    assert_bits(&format!("{what} out vs Reference"), &got.out, &mo);
    assert_bits(&format!("{what} lse vs Reference"), &got.lse, &ml);
    got
}

fn forward_cases(dt: Dt) -> Vec<(String, Problem)> {
    let mut cases = Vec::new();
    for causal in [false, true] {
        cases.push((
            format!("{dt:?} causal={causal} D=72 GQA 4/2"),
            Problem::new(11, 2, 4, 2, 37, 150, 72, causal, dt).with_lens(&[150, 61]),
        ));
        cases.push((
            format!("{dt:?} causal={causal} D=40 ragged"),
            Problem::new(12, 3, 2, 1, 37, 150, 40, causal, dt).with_lens(&[150, 0, 20]),
        ));
    }
    // One KV head per query head, head size above 128 (the dK/dV kernel's 32-key tiles).
    cases.push((
        format!("{dt:?} causal D=130 MHA"),
        Problem::new(13, 1, 2, 2, 20, 70, 130, true, dt).with_lens(&[66]),
    ));
    cases
}

fn forward_values_on<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    for (what, p) in forward_cases(dt) {
        check_forward(client, &p, &what);
    }
}

#[test]
fn forward_values_f32() {
    with_wgpu("forward_values_f32", |client| {
        forward_values_on(client, Dt::F32)
    });
}

#[test]
fn forward_values_f16() {
    with_wgpu("forward_values_f16", |client| {
        forward_values_on(client, Dt::F16)
    });
}

fn check_backward<R: Runtime>(client: &ComputeClient<R>, p: &Problem, what: &str) {
    let g = grad_for(p, 99);
    let (fwd, got) = backward(client, p, &g);
    let (dq, dk, dv) = reference_grads_f64(p, &g);
    assert_close(&format!("{what} dq"), &got.dq, &dq, rtol(p.dt));
    assert_close(&format!("{what} dk"), &got.dk, &dk, rtol(p.dt));
    assert_close(&format!("{what} dv"), &got.dv, &dv, rtol(p.dt));
    let (mq, mk, mv) = mirror::backward(p, &fwd.out, &fwd.lse, &g);
    assert_bits(&format!("{what} dq vs Reference"), &got.dq, &mq);
    assert_bits(&format!("{what} dk vs Reference"), &got.dk, &mk);
    assert_bits(&format!("{what} dv vs Reference"), &got.dv, &mv);
}

fn backward_values_on<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    for (what, p) in forward_cases(dt) {
        check_backward(client, &p, &what);
    }
}

#[test]
fn backward_values_f32() {
    with_wgpu("backward_values_f32", |client| {
        backward_values_on(client, Dt::F32)
    });
}

#[test]
fn backward_values_f16() {
    with_wgpu("backward_values_f16", |client| {
        backward_values_on(client, Dt::F16)
    });
}

/// Rows `[b]` of a problem as a problem of their own (optionally shorter KV: the cache so far).
fn select_rows(p: &Problem, rows: &[usize], kv: usize) -> Problem {
    let mut s = p.clone();
    s.b = rows.len();
    s.kv = kv;
    s.query = rows
        .iter()
        .flat_map(|&b| p.query[p.q_at(b, 0, 0)..p.q_at(b + 1, 0, 0)].to_vec())
        .collect();
    let take = |x: &[f32]| -> Vec<f32> {
        rows.iter()
            .flat_map(|&b| {
                (0..p.kh)
                    .flat_map(move |kh| x[p.kv_at(b, kh, 0)..p.kv_at(b, kh, 0) + kv * p.d].to_vec())
            })
            .collect()
    };
    s.key = take(&p.key);
    s.value = take(&p.value);
    s.lens = rows.iter().map(|&b| p.lens[b].min(kv as i32)).collect();
    s
}

/// Queries `i0..i1` of every head (a problem with Q = i1 − i0).
fn select_queries(p: &Problem, i0: usize, i1: usize) -> Problem {
    let mut s = p.clone();
    s.q = i1 - i0;
    s.query = (0..p.b * p.h)
        .flat_map(|bh| p.query[(bh * p.q + i0) * p.d..(bh * p.q + i1) * p.d].to_vec())
        .collect();
    s
}

/// Rows `i0..i1` of every (b, h) of a `[B, H, Q, ..]` result with `w` values per query.
fn query_slice(x: &[f32], p: &Problem, i0: usize, i1: usize, w: usize) -> Vec<f32> {
    (0..p.b * p.h)
        .flat_map(|bh| x[(bh * p.q + i0) * w..(bh * p.q + i1) * w].to_vec())
        .collect()
}

fn decode_equals_prefill_on<R: Runtime>(client: &ComputeClient<R>) {
    let n = 70;
    let p = Problem::new(21, 1, 4, 2, n, n, 40, true, Dt::F32);
    let full = forward(client, &p);
    for t in 0..n {
        // The cache holds keys 0..=t; the rest of its buffer is garbage.
        let mut dec = select_queries(&p, t, t + 1).with_lens(&[t as i32 + 1]);
        dec.poison_past_lens();
        let got = forward(client, &dec);
        assert_bits(
            &format!("decode t={t} out"),
            &got.out,
            &query_slice(&full.out, &p, t, t + 1, p.d),
        );
        assert_bits(
            &format!("decode t={t} lse"),
            &got.lse,
            &query_slice(&full.lse, &p, t, t + 1, 1),
        );
    }
}

#[test]
fn decode_equals_prefill() {
    with_wgpu("decode_equals_prefill", |client| {
        decode_equals_prefill_on(client)
    });
}

fn chunked_prefill_equals_one_call_on<R: Runtime>(client: &ComputeClient<R>) {
    let n = 70;
    let p = Problem::new(22, 1, 4, 2, n, n, 72, true, Dt::F32);
    let full = forward(client, &p);
    let h = n / 2;
    let first = forward(client, &select_queries(&p, 0, h).with_lens(&[h as i32]));
    let second = forward(client, &select_queries(&p, h, n));
    assert_bits(
        "first chunk out",
        &first.out,
        &query_slice(&full.out, &p, 0, h, p.d),
    );
    assert_bits(
        "first chunk lse",
        &first.lse,
        &query_slice(&full.lse, &p, 0, h, 1),
    );
    assert_bits(
        "second chunk out",
        &second.out,
        &query_slice(&full.out, &p, h, n, p.d),
    );
    assert_bits(
        "second chunk lse",
        &second.lse,
        &query_slice(&full.lse, &p, h, n, 1),
    );
}

#[test]
fn chunked_prefill_equals_one_call() {
    with_wgpu("chunked_prefill_equals_one_call", |client| {
        chunked_prefill_equals_one_call_on(client)
    });
}

/// Keys past one split (`ATTENTION_KEY_SPLIT`): values and the Reference's bits (f32, f16) on
/// ragged rows with NaN past them, and decode = prefill at and around the split boundaries.
fn long_keys_on<R: Runtime>(client: &ComputeClient<R>) {
    let kv = 2 * ATTENTION_KEY_SPLIT + 100;
    for dt in [Dt::F32, Dt::F16] {
        for causal in [false, true] {
            // Head size 24: the FMA path on every device, so the Reference's bits for f16 too.
            let mut p = Problem::new(23, 2, 4, 2, 5, kv, 24, causal, dt)
                .with_lens(&[kv as i32, ATTENTION_KEY_SPLIT as i32 + 3]);
            p.poison_past_lens();
            check_forward(client, &p, &format!("long keys {dt:?} causal={causal}"));
        }
    }
    let p = Problem::new(24, 1, 2, 1, kv, kv, 24, true, Dt::F32);
    let full = forward(client, &p);
    decode_rows_equal(client, &p, &full, "long keys");
}

/// Decode of the queries at and around the split boundaries of `p` (Q = KV, causal; the cache
/// past the token NaN), each = its row of `full`, bitwise, by every split execution.
fn decode_rows_equal<R: Runtime>(client: &ComputeClient<R>, p: &Problem, full: &Fwd, what: &str) {
    let s = ATTENTION_KEY_SPLIT;
    for t in [s - 1, s, s + 1, 2 * s - 1, 2 * s, p.q - 1] {
        let mut dec = select_queries(p, t, t + 1).with_lens(&[t as i32 + 1]);
        dec.poison_past_lens();
        for ex in [
            SplitExecution::Auto,
            SplitExecution::InCube,
            SplitExecution::Parts,
        ] {
            let got = forward_with(client, &dec, ex);
            let what = format!("{what} decode t={t} {ex:?}");
            let want = query_slice(&full.out, p, t, t + 1, p.d);
            assert_bits(&format!("{what} out"), &got.out, &want);
            let want = query_slice(&full.lse, p, t, t + 1, 1);
            assert_bits(&format!("{what} lse"), &got.lse, &want);
        }
    }
}

#[test]
fn long_keys() {
    with_wgpu("long_keys", long_keys_on);
}

fn batch_slice(x: &[f32], b: usize, per_row: usize) -> Vec<f32> {
    x[b * per_row..(b + 1) * per_row].to_vec()
}

fn batch_row_and_ragged_invariance_on<R: Runtime>(client: &ComputeClient<R>) {
    for causal in [false, true] {
        // A row alone = the same row in a batch of 3 with other data.
        let p = Problem::new(31, 3, 4, 2, 37, 100, 40, causal, Dt::F32).with_lens(&[100, 80, 100]);
        let g = grad_for(&p, 5);
        let (fwd, grads) = backward(client, &p, &g);
        let alone = select_rows(&p, &[1], p.kv);
        let ga = batch_slice(&g, 1, p.h * p.q * p.d);
        let (fa, gra) = backward(client, &alone, &ga);
        let (qd, kd) = (p.h * p.q * p.d, p.kh * p.kv * p.d);
        assert_bits("batch out", &fa.out, &batch_slice(&fwd.out, 1, qd));
        assert_bits("batch lse", &fa.lse, &batch_slice(&fwd.lse, 1, p.h * p.q));
        assert_bits("batch dq", &gra.dq, &batch_slice(&grads.dq, 1, qd));
        assert_bits("batch dk", &gra.dk, &batch_slice(&grads.dk, 1, kd));
        assert_bits("batch dv", &gra.dv, &batch_slice(&grads.dv, 1, kd));

        // Ragged kv_lens with NaN past them = each row unpadded.
        let mut r =
            Problem::new(32, 4, 4, 2, 13, 100, 40, causal, Dt::F32).with_lens(&[100, 17, 0, 64]);
        r.poison_past_lens();
        let g = grad_for(&r, 6);
        let (fwd, grads) = backward(client, &r, &g);
        for b in 0..r.b {
            let len = r.lens[b] as usize;
            let alone = select_rows(&r, &[b], len);
            let ga = batch_slice(&g, b, r.h * r.q * r.d);
            let (fa, gra) = backward(client, &alone, &ga);
            let (qd, kd) = (r.h * r.q * r.d, r.kh * r.kv * r.d);
            assert_bits("ragged out", &fa.out, &batch_slice(&fwd.out, b, qd));
            assert_bits("ragged lse", &fa.lse, &batch_slice(&fwd.lse, b, r.h * r.q));
            assert_bits("ragged dq", &gra.dq, &batch_slice(&grads.dq, b, qd));
            let dk = batch_slice(&grads.dk, b, kd);
            let dv = batch_slice(&grads.dv, b, kd);
            for kh in 0..r.kh {
                let at = |j: usize| (kh * r.kv + j) * r.d;
                let un = |j: usize| (kh * len + j) * r.d;
                assert_bits("ragged dk", &dk[at(0)..at(len)], &gra.dk[un(0)..un(len)]);
                assert_bits("ragged dv", &dv[at(0)..at(len)], &gra.dv[un(0)..un(len)]);
                // Keys past the row's length get exact zeros.
                assert!(
                    dk[at(len)..at(r.kv)]
                        .iter()
                        .chain(&dv[at(len)..at(r.kv)])
                        .all(|x| x.to_bits() == 0)
                );
            }
        }
    }
}

#[test]
fn batch_row_and_ragged_invariance() {
    with_wgpu("batch_row_and_ragged_invariance", |client| {
        batch_row_and_ragged_invariance_on(client)
    });
}

fn rerun_is_bitwise_equal_on<R: Runtime>(client: &ComputeClient<R>) {
    let p = Problem::new(41, 2, 4, 2, 37, 150, 72, true, Dt::F32).with_lens(&[150, 61]);
    let g = grad_for(&p, 7);
    let a = backward(client, &p, &g);
    let b = backward(client, &p, &g);
    assert_bits("rerun out", &a.0.out, &b.0.out);
    assert_bits("rerun lse", &a.0.lse, &b.0.lse);
    assert_bits("rerun dq", &a.1.dq, &b.1.dq);
    assert_bits("rerun dk", &a.1.dk, &b.1.dk);
    assert_bits("rerun dv", &a.1.dv, &b.1.dv);
}

#[test]
fn rerun_is_bitwise_equal() {
    with_wgpu("rerun_is_bitwise_equal", |client| {
        rerun_is_bitwise_equal_on(client)
    });
}

fn backward_padding_rows_change_nothing_on<R: Runtime>(client: &ComputeClient<R>) {
    // Non-causal, so appending queries does not change what the others see.
    let p = Problem::new(51, 2, 4, 2, 20, 90, 40, false, Dt::F32);
    padding_changes_no_gradient(client, &p, 8, 5, "padded");
}

/// `p`'s gradients with `extra` queries appended to every head (NaN, zero upstream) equal those
/// without them; the appended rows' `dq` are zeros.
fn padding_changes_no_gradient<R: Runtime>(
    client: &ComputeClient<R>,
    p: &Problem,
    seed: u64,
    extra: usize,
    what: &str,
) {
    let g = grad_for(p, seed);
    let (_, base) = backward(client, p, &g);
    let mut big = p.clone();
    big.q = p.q + extra;
    let mut gb = Vec::new();
    big.query.clear();
    for bh in 0..p.b * p.h {
        big.query
            .extend_from_slice(&p.query[bh * p.q * p.d..(bh + 1) * p.q * p.d]);
        big.query.extend(std::iter::repeat_n(f32::NAN, extra * p.d));
        gb.extend_from_slice(&g[bh * p.q * p.d..(bh + 1) * p.q * p.d]);
        gb.extend(std::iter::repeat_n(0.0f32, extra * p.d));
    }
    let (_, got) = backward(client, &big, &gb);
    assert_bits(&format!("{what} dk"), &got.dk, &base.dk);
    assert_bits(&format!("{what} dv"), &got.dv, &base.dv);
    assert_bits(
        &format!("{what} dq rows"),
        &query_slice(&got.dq, &big, 0, p.q, p.d),
        &base.dq,
    );
    assert!(
        query_slice(&got.dq, &big, p.q, big.q, p.d)
            .iter()
            .all(|x| x.to_bits() == 0),
        "{what}: the padding rows' dq"
    );
}

#[test]
fn backward_padding_rows_change_nothing() {
    with_wgpu("backward_padding_rows_change_nothing", |client| {
        backward_padding_rows_change_nothing_on(client)
    });
}

fn strided_layouts_equal_dense_on<R: Runtime>(client: &ComputeClient<R>) {
    let p = Problem::new(61, 2, 4, 2, 19, 70, 40, true, Dt::F32).with_lens(&[70, 33]);
    let g = grad_for(&p, 9);
    let (fwd, grads) = backward(client, &p, &g);
    // Every tensor stored as [B, S, heads, D] (sequence-major) and viewed as [B, heads, S, D].
    let perm = |x: &[f32], heads: usize, s: usize| -> Vec<f32> {
        let mut t = vec![0.0f32; x.len()];
        for b in 0..p.b {
            for h in 0..heads {
                for i in 0..s {
                    for c in 0..p.d {
                        t[((b * s + i) * heads + h) * p.d + c] =
                            x[((b * heads + h) * s + i) * p.d + c];
                    }
                }
            }
        }
        t
    };
    let seq_view = |data: &[f32], heads: usize, s: usize, dt: Dt| -> Buf<R> {
        let handle = client.create_from_slice(&dt.encode(&perm(data, heads, s)));
        let binding = view(
            &handle,
            &[p.b, heads, s, p.d],
            &[s * heads * p.d, p.d, heads * p.d, 1],
        );
        Buf {
            handle,
            binding,
            dt_size: dt.size(),
        }
    };
    let unperm = |x: &[f32], heads: usize, s: usize| -> Vec<f32> {
        let mut t = vec![0.0f32; x.len()];
        for b in 0..p.b {
            for h in 0..heads {
                for i in 0..s {
                    for c in 0..p.d {
                        t[((b * heads + h) * s + i) * p.d + c] =
                            x[((b * s + i) * heads + h) * p.d + c];
                    }
                }
            }
        }
        t
    };
    let dev = Dev {
        q: seq_view(&p.query, p.h, p.q, p.dt),
        k: seq_view(&p.key, p.kh, p.kv, p.dt),
        v: seq_view(&p.value, p.kh, p.kv, p.dt),
        lens: upload_i32(client, &p.lens),
    };
    let zeros_q = vec![0.0f32; p.b * p.h * p.q * p.d];
    let zeros_k = vec![0.0f32; p.b * p.kh * p.kv * p.d];
    let out = seq_view(&zeros_q, p.h, p.q, p.dt);
    let lse = alloc(client, &[p.b, p.h, p.q], &[1, p.b, p.b * p.h], Dt::F32);
    attention_forward(client, &refs(&dev, &p), out.b(), lse.b()).expect("forward");
    let read = |b: &Buf<R>, n: usize| read_raw(client, b, p.dt)[..n].to_vec();
    let nq = zeros_q.len();
    assert_bits("strided out", &unperm(&read(&out, nq), p.h, p.q), &fwd.out);
    let l = read_raw(client, &lse, Dt::F32);
    let lse_dense: Vec<f32> = (0..p.b * p.h * p.q)
        .map(|row| {
            let (bh, i) = (row / p.q, row % p.q);
            l[bh % p.h * p.b + bh / p.h + i * p.b * p.h]
        })
        .collect();
    assert_bits("strided lse", &lse_dense, &fwd.lse);
    let go = seq_view(&g, p.h, p.q, p.dt);
    let dq = seq_view(&zeros_q, p.h, p.q, p.dt);
    let dk = seq_view(&zeros_k, p.kh, p.kv, p.dt);
    let dv = seq_view(&zeros_k, p.kh, p.kv, p.dt);
    let ws = alloc_dense(
        client,
        &[attention_backward_workspace_len(p.b, p.h, p.q)],
        Dt::F32,
    );
    let gr = AttentionGradRefs {
        out: out.b(),
        lse: lse.b(),
        grad_out: go.b(),
        grad_query: dq.b(),
        grad_key: dk.b(),
        grad_value: dv.b(),
        workspace: ws.b(),
    };
    attention_backward(client, &refs(&dev, &p), &gr).expect("backward");
    assert_bits("strided dq", &unperm(&read(&dq, nq), p.h, p.q), &grads.dq);
    assert_bits(
        "strided dk",
        &unperm(&read(&dk, zeros_k.len()), p.kh, p.kv),
        &grads.dk,
    );
    assert_bits(
        "strided dv",
        &unperm(&read(&dv, zeros_k.len()), p.kh, p.kv),
        &grads.dv,
    );
}

#[test]
fn strided_layouts_equal_dense() {
    with_wgpu("strided_layouts_equal_dense", |client| {
        strided_layouts_equal_dense_on(client)
    });
}

fn zero_sizes_on<R: Runtime>(client: &ComputeClient<R>) {
    // B·H·Q = 0: nothing to do; KV = 0 (and kv_lens 0): zeros and −∞; D = 0: lse only.
    for (b, h, kh, q, kv, d) in [
        (0, 4, 2, 5, 9, 8),
        (2, 4, 2, 0, 9, 8),
        (2, 4, 2, 5, 0, 8),
        (2, 4, 2, 5, 9, 0),
    ] {
        let p = Problem::new(71, b, h, kh, q, kv, d, true, Dt::F32);
        let what = format!("B={b} Q={q} KV={kv} D={d}");
        let g = grad_for(&p, 1);
        let (fwd, grads) = backward(client, &p, &g);
        let (mo, ml) = mirror::forward(&p);
        assert_bits(&format!("{what} out"), &fwd.out, &mo);
        assert_bits(&format!("{what} lse"), &fwd.lse, &ml);
        let (mq, mk, mv) = mirror::backward(&p, &fwd.out, &fwd.lse, &g);
        assert_bits(&format!("{what} dq"), &grads.dq, &mq);
        assert_bits(&format!("{what} dk"), &grads.dk, &mk);
        assert_bits(&format!("{what} dv"), &grads.dv, &mv);
    }
}

#[test]
fn zero_sizes() {
    with_wgpu("zero_sizes", zero_sizes_on);
}

fn limits_and_errors_on<R: Runtime>(client: &ComputeClient<R>) {
    let ok = AttentionDims {
        batch: 2,
        heads: 8,
        kv_heads: 2,
        q_len: 100,
        kv_len: 1000,
        head_dim: 256,
    };
    attention_limits(client, ok).expect("within limits");
    let big_d = AttentionDims {
        head_dim: ATTENTION_MAX_HEAD_DIM + 1,
        ..ok
    };
    assert!(matches!(
        attention_limits(client, big_d),
        Err(KernelError::Unsupported { .. })
    ));
    let bad_group = AttentionDims { kv_heads: 3, ..ok };
    assert!(matches!(
        attention_limits(client, bad_group),
        Err(KernelError::Shape { .. })
    ));
    let huge = AttentionDims {
        batch: 1 << 20,
        q_len: 1 << 12,
        ..ok
    };
    assert!(matches!(
        attention_limits(client, huge),
        Err(KernelError::IndexOverflow { .. })
    ));
    // A wrong value shape is refused before anything runs.
    let p = Problem::new(81, 1, 2, 1, 4, 8, 8, false, Dt::F32);
    attention_limits(client, p.dims()).expect("small problem");
    let dev = upload_problem(client, &p);
    let bad_v = upload(client, &p.value, &[1, 1, 8, 4], Dt::F32);
    let mut r = refs(&dev, &p);
    r.value = bad_v.b();
    let out = alloc_dense(client, &[1, 2, 4, 8], Dt::F32);
    let lse = alloc_dense(client, &[1, 2, 4], Dt::F32);
    assert!(matches!(
        attention_forward(client, &r, out.b(), lse.b()),
        Err(KernelError::Shape { arg: "value", .. })
    ));
    assert_eq!(ATTENTION_KEY_BLOCK, 64);
}

#[test]
fn limits_and_errors() {
    with_wgpu("limits_and_errors", limits_and_errors_on);
}

/// Every check above on CUDA (f32, f16 and bf16), with the device's fused `fma`.
#[cfg(feature = "cuda")]
#[test]
fn attention_cuda() {
    with_cuda(|client| {
        math_matches_reference_bitwise_on(client);
        for dt in [Dt::F32, Dt::F16, Dt::BF16] {
            forward_values_on(client, dt);
            backward_values_on(client, dt);
        }
        decode_equals_prefill_on(client);
        chunked_prefill_equals_one_call_on(client);
        long_keys_on(client);
        batch_row_and_ragged_invariance_on(client);
        rerun_is_bitwise_equal_on(client);
        backward_padding_rows_change_nothing_on(client);
        strided_layouts_equal_dense_on(client);
        zero_sizes_on(client);
        limits_and_errors_on(client);
    });
}

// ---------------------------------------------------------------------------------------------
// The tensor-core forward (f16 / bf16, head sizes multiples of 16 up to 128, CUDA): not the
// Reference's bits, so values against f64 and every invariance bitwise, on shapes that are
// multiples of no tile (Q 37, KV 101, GQA 4:1, ragged lengths, NaN past them).

/// The forward f16 / bf16 takes on `client` is the tensor-core one for these head sizes, the
/// FMA one for f32 and other head sizes.
#[cfg(feature = "cuda")]
fn tc_path_is_taken_on<R: Runtime>(client: &ComputeClient<R>) {
    for dt in [FloatDType::F16, FloatDType::BF16] {
        for d in [16, 64, 96, 128] {
            assert!(
                attention_forward_uses_tensor_cores(client, dt, d),
                "{dt:?} D={d}: expected the tensor-core forward"
            );
        }
        for d in [40, 72, 130, 256] {
            assert!(!attention_forward_uses_tensor_cores(client, dt, d));
        }
    }
    assert!(!attention_forward_uses_tensor_cores(
        client,
        FloatDType::F32,
        64
    ));
    assert!(
        attention_forward_copies_async(client),
        "expected the tensor-core forward to stage K and V by cp.async"
    );
}

/// K and V staged by `cp.async` and through registers give the same bits: one cube per tile
/// and by parts past a split, 64-row and 16-row (decode) tiles, ragged lengths with NaN past
/// them.
#[cfg(feature = "cuda")]
fn tc_staging_changes_no_bit_on<R: Runtime>(client: &ComputeClient<R>) {
    let kv = ATTENTION_KEY_SPLIT + 301;
    for dt in [Dt::F16, Dt::BF16] {
        for d in [64, 128] {
            for causal in [false, true] {
                for q in [kv, 1] {
                    let mut p = Problem::new(61, 2, 8, 2, q, kv, d, causal, dt)
                        .with_lens(&[kv as i32, 700]);
                    p.poison_past_lens();
                    for ex in [SplitExecution::InCube, SplitExecution::Parts] {
                        let what = format!("tc staging {dt:?} D={d} causal={causal} Q={q} {ex:?}");
                        let copied = with_async_staging(|| forward_with(client, &p, ex));
                        let staged = forward_with(client, &p, ex);
                        assert_bits(&format!("{what} out"), &copied.out, &staged.out);
                        assert_bits(&format!("{what} lse"), &copied.lse, &staged.lse);
                    }
                }
            }
        }
    }
}

fn tc_problem(seed: u64, d: usize, causal: bool, dt: Dt) -> Problem {
    let mut p = Problem::new(seed, 3, 8, 2, 37, 101, d, causal, dt).with_lens(&[101, 45, 0]);
    p.poison_past_lens();
    p
}

/// Values (forward and backward) against f64.
fn tc_values_on<R: Runtime>(client: &ComputeClient<R>, dts: &[Dt]) {
    for &dt in dts {
        for d in [64, 128] {
            for causal in [false, true] {
                let p = tc_problem(51, d, causal, dt);
                let what = format!("tc {dt:?} D={d} causal={causal}");
                let got = forward(client, &p);
                let (out, lse) = reference_f64(&p);
                assert_close(&format!("{what} out"), &got.out, &out, rtol(dt));
                assert_close(&format!("{what} lse"), &got.lse, &lse, rtol(dt));
                let g = grad_for(&p, 98);
                let (_, grads) = backward(client, &p, &g);
                let (dq, dk, dv) = reference_grads_f64(&p, &g);
                assert_close(&format!("{what} dq"), &grads.dq, &dq, 2.0 * rtol(dt));
                assert_close(&format!("{what} dk"), &grads.dk, &dk, 2.0 * rtol(dt));
                assert_close(&format!("{what} dv"), &grads.dv, &dv, 2.0 * rtol(dt));
            }
        }
    }
}

/// Decode one token at a time (cache past the token: NaN) = prefill = chunked prefill, bitwise.
#[cfg(feature = "cuda")]
fn tc_decode_equals_prefill_on<R: Runtime>(client: &ComputeClient<R>) {
    let n = 70;
    for dt in [Dt::F16, Dt::BF16] {
        for d in [64, 128] {
            let p = Problem::new(52, 1, 8, 2, n, n, d, true, dt);
            let full = forward(client, &p);
            for t in 0..n {
                let mut dec = select_queries(&p, t, t + 1).with_lens(&[t as i32 + 1]);
                dec.poison_past_lens();
                let got = forward(client, &dec);
                let what = format!("tc decode {dt:?} D={d} t={t}");
                let want = query_slice(&full.out, &p, t, t + 1, p.d);
                assert_bits(&format!("{what} out"), &got.out, &want);
                let want = query_slice(&full.lse, &p, t, t + 1, 1);
                assert_bits(&format!("{what} lse"), &got.lse, &want);
            }
            let h = 29;
            let first = forward(client, &select_queries(&p, 0, h).with_lens(&[h as i32]));
            let second = forward(client, &select_queries(&p, h, n));
            let want = query_slice(&full.out, &p, 0, h, p.d);
            assert_bits("tc first chunk out", &first.out, &want);
            let want = query_slice(&full.out, &p, h, n, p.d);
            assert_bits("tc second chunk out", &second.out, &want);
            let want = query_slice(&full.lse, &p, h, n, 1);
            assert_bits("tc second chunk lse", &second.lse, &want);
        }
    }
}

/// A row alone (its cache unpadded) = the row in a ragged batch with NaN past the lengths;
/// reruns equal.
fn tc_batch_invariance_on<R: Runtime>(client: &ComputeClient<R>, dts: &[Dt]) {
    for &dt in dts {
        for d in [64, 128] {
            for causal in [false, true] {
                let p = tc_problem(53, d, causal, dt);
                let fwd = forward(client, &p);
                assert_eq!(fwd, forward(client, &p), "tc rerun");
                let (qd, ld) = (p.h * p.q * p.d, p.h * p.q);
                for b in 0..p.b {
                    let alone = select_rows(&p, &[b], p.lens[b] as usize);
                    let fa = forward(client, &alone);
                    let what = format!("tc {dt:?} D={d} causal={causal} row {b}");
                    let want = batch_slice(&fwd.out, b, qd);
                    assert_bits(&format!("{what} out"), &fa.out, &want);
                    let want = batch_slice(&fwd.lse, b, ld);
                    assert_bits(&format!("{what} lse"), &fa.lse, &want);
                }
            }
        }
    }
}

/// The backward where it runs on the tensor cores: a row alone = the row in a ragged batch
/// (NaN past the lengths; keys past a row's length get exact zeros), appended padding queries
/// (NaN, zero upstream) change no gradient, reruns equal; dq, dk, dv bitwise.
#[cfg(feature = "cuda")]
fn tc_backward_invariance_on<R: Runtime>(client: &ComputeClient<R>, dts: &[Dt]) {
    for &dt in dts {
        for d in [64, 128] {
            for causal in [false, true] {
                let p = tc_problem(54, d, causal, dt);
                let g = grad_for(&p, 9);
                let (_, grads) = backward(client, &p, &g);
                let (_, again) = backward(client, &p, &g);
                assert_eq!(grads, again, "tc backward rerun");
                let (qd, kd) = (p.h * p.q * p.d, p.kh * p.kv * p.d);
                for b in 0..p.b {
                    let len = p.lens[b] as usize;
                    let alone = select_rows(&p, &[b], len);
                    let ga = batch_slice(&g, b, qd);
                    let (_, gra) = backward(client, &alone, &ga);
                    let what = format!("tc backward {dt:?} D={d} causal={causal} row {b}");
                    assert_bits(
                        &format!("{what} dq"),
                        &gra.dq,
                        &batch_slice(&grads.dq, b, qd),
                    );
                    let dk = batch_slice(&grads.dk, b, kd);
                    let dv = batch_slice(&grads.dv, b, kd);
                    for kh in 0..p.kh {
                        let at = |j: usize| (kh * p.kv + j) * p.d;
                        let un = |j: usize| (kh * len + j) * p.d;
                        assert_bits(
                            &format!("{what} dk"),
                            &dk[at(0)..at(len)],
                            &gra.dk[un(0)..un(len)],
                        );
                        assert_bits(
                            &format!("{what} dv"),
                            &dv[at(0)..at(len)],
                            &gra.dv[un(0)..un(len)],
                        );
                        assert!(
                            dk[at(len)..at(p.kv)]
                                .iter()
                                .chain(&dv[at(len)..at(p.kv)])
                                .all(|x| x.to_bits() == 0),
                            "{what}: keys past the length"
                        );
                    }
                }
            }
            // Appended padding queries; non-causal so the others see the same keys.
            let p = Problem::new(55, 2, 8, 2, 37, 90, d, false, dt);
            padding_changes_no_gradient(client, &p, 10, 30, &format!("tc padded {dt:?} D={d}"));
        }
    }
}

/// Keys past one split on the tensor cores: each split in a cube of its own then merged = one
/// cube walking every split, bitwise (values against f64); a ragged row alone = in its batch;
/// decode at and around the split boundaries = prefill, by every execution.
#[cfg(feature = "cuda")]
fn tc_long_keys_on<R: Runtime>(client: &ComputeClient<R>) {
    let kv = 2 * ATTENTION_KEY_SPLIT + 500;
    for dt in [Dt::F16, Dt::BF16] {
        for d in [64, 128] {
            for causal in [false, true] {
                let len1 = ATTENTION_KEY_SPLIT as i32 + 477;
                let mut p =
                    Problem::new(56, 2, 8, 2, 37, kv, d, causal, dt).with_lens(&[kv as i32, len1]);
                p.poison_past_lens();
                let what = format!("tc long keys {dt:?} D={d} causal={causal}");
                let one = forward_with(client, &p, SplitExecution::InCube);
                let parts = forward_with(client, &p, SplitExecution::Parts);
                assert_bits(&format!("{what} parts out"), &parts.out, &one.out);
                assert_bits(&format!("{what} parts lse"), &parts.lse, &one.lse);
                if d == 128 {
                    let (out, lse) = reference_f64(&p);
                    assert_close(&format!("{what} out"), &one.out, &out, rtol(dt));
                    assert_close(&format!("{what} lse"), &one.lse, &lse, rtol(dt));
                }
                let alone = select_rows(&p, &[1], len1 as usize);
                let fa = forward(client, &alone);
                let (qd, ld) = (p.h * p.q * p.d, p.h * p.q);
                assert_bits(
                    &format!("{what} row alone out"),
                    &fa.out,
                    &batch_slice(&one.out, 1, qd),
                );
                assert_bits(
                    &format!("{what} row alone lse"),
                    &fa.lse,
                    &batch_slice(&one.lse, 1, ld),
                );
            }
            let n = 2 * ATTENTION_KEY_SPLIT + 200;
            let p = Problem::new(57, 1, 8, 2, n, n, d, true, dt);
            let full = forward_with(client, &p, SplitExecution::InCube);
            decode_rows_equal(client, &p, &full, &format!("tc long keys {dt:?} D={d}"));
        }
    }
}

/// The tensor-core forward's and backward's checks; on a device without them they run the FMA
/// kernels.
#[cfg(feature = "cuda")]
#[test]
fn attention_tc_cuda() {
    with_cuda(|client| {
        tc_path_is_taken_on(client);
        tc_values_on(client, &[Dt::F16, Dt::BF16]);
        tc_decode_equals_prefill_on(client);
        tc_long_keys_on(client);
        tc_staging_changes_no_bit_on(client);
        tc_batch_invariance_on(client, &[Dt::F16, Dt::BF16]);
        tc_backward_invariance_on(client, &[Dt::F16, Dt::BF16]);
    });
}

/// The same checks on the FMA path (f16: WGSL has no bf16), which they hold for too.
#[test]
fn attention_tc_checks_on_the_fma_path() {
    with_wgpu("attention_tc_checks_on_the_fma_path", |client| {
        tc_values_on(client, &[Dt::F16]);
        tc_batch_invariance_on(client, &[Dt::F16]);
    });
}
