//! The Reference arithmetic of `attention` on host f32 slices (docs/CONTRACT.md, *attention
//! semantics*): the exact operations the CubeCl FMA kernels run, element by element.
use std::ops::Range;

use rayon::prelude::*;

use crate::ops::math::{exp_p, ln_p};

/// Keys are walked in blocks of this many from key 0 (docs/CONTRACT.md, *attention semantics*).
pub const ATTENTION_KEY_BLOCK: usize = 64;

/// The softmax restarts every this many keys from key 0, and the splits a query sees merge in
/// ascending order (docs/CONTRACT.md, *attention semantics*).
pub const ATTENTION_KEY_SPLIT: usize = 1024;

/// Sizes and options of one attention call; every buffer is contiguous row-major.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    /// Batch rows.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`heads % kv_heads == 0`).
    pub kv_heads: usize,
    /// Queries per row.
    pub q_len: usize,
    /// Keys per row (the tensors' length; `kv_lens` may be shorter).
    pub kv_len: usize,
    /// Head size.
    pub head_dim: usize,
    /// Whether query `i` sees only keys up to its position.
    pub causal: bool,
    /// Score scale, as f32.
    pub scale: f32,
}

impl AttentionShape {
    /// The keys query `i` of a row with `kv_len_b` valid keys sees (`0..n`), or `None` when its
    /// position is negative.
    pub fn visible(&self, kv_len_b: usize, i: usize) -> Option<usize> {
        let pos = kv_len_b as i64 - self.q_len as i64 + i as i64;
        if pos < 0 {
            None
        } else if self.causal {
            Some(pos as usize + 1)
        } else {
            Some(kv_len_b)
        }
    }

    fn kv_head(&self, h: usize) -> usize {
        h / (self.heads / self.kv_heads)
    }

    fn q_at(&self, b: usize, h: usize, i: usize) -> usize {
        ((b * self.heads + h) * self.q_len + i) * self.head_dim
    }

    fn kv_at(&self, b: usize, kh: usize, j: usize) -> usize {
        ((b * self.kv_heads + kh) * self.kv_len + j) * self.head_dim
    }
}

/// `fma`-chain dot product from +0.0, ascending.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0f32, |acc, (&x, &y)| x.mul_add(y, acc))
}

/// `q'_d = q_d · scale`.
fn scaled(q: &[f32], scale: f32) -> Vec<f32> {
    q.iter().map(|&x| x * scale).collect()
}

/// One query's forward: `out` (f32, before the dtype rounding) and `lse`.
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
    for s0 in (0..visible).step_by(ATTENTION_KEY_SPLIT) {
        let (m, l, o) = split_state(&q, k, v, s0..visible.min(s0 + ATTENTION_KEY_SPLIT));
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

/// `(m, l, o)` of the keys `keys` (one split) in blocks of ATTENTION_KEY_BLOCK from its first key.
fn split_state(q: &[f32], k: &[f32], v: &[f32], keys: Range<usize>) -> (f32, f32, Vec<f32>) {
    let d = q.len();
    let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
    let mut o = vec![0.0f32; d];
    let mut o_b = vec![0.0f32; d];
    let mut s = [0.0f32; ATTENTION_KEY_BLOCK];
    for start in keys.clone().step_by(ATTENTION_KEY_BLOCK) {
        let block = start..keys.end.min(start + ATTENTION_KEY_BLOCK);
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

/// Forward: `(out [B, H, Q, D], lse [B, H, Q])`, f32. Queries with a negative position get zeros
/// and `lse = −∞`.
pub fn attention_forward(
    shape: &AttentionShape,
    query: &[f32],
    key: &[f32],
    value: &[f32],
    kv_lens: &[usize],
) -> (Vec<f32>, Vec<f32>) {
    let d = shape.head_dim;
    let rows = shape.batch * shape.heads * shape.q_len;
    let run = |row: usize, out: &mut [f32]| {
        let (bh, i) = (row / shape.q_len, row % shape.q_len);
        let (b, h) = (bh / shape.heads, bh % shape.heads);
        let visible = shape.visible(kv_lens[b], i)?;
        let kv = shape.kv_at(b, shape.kv_head(h), 0);
        let span = kv..kv + shape.kv_len * d;
        let q = &query[shape.q_at(b, h, i)..][..d];
        Some(forward_row(
            q,
            &key[span.clone()],
            &value[span],
            visible,
            shape.scale,
            out,
        ))
    };
    let mut out = vec![0.0f32; rows * d];
    // Rows are walked by index, so that `d = 0` still gives each row its `lse`.
    let lse: Vec<Option<f32>> = if d == 0 {
        (0..rows)
            .into_par_iter()
            .map(|row| run(row, &mut []))
            .collect()
    } else {
        out.par_chunks_mut(d)
            .enumerate()
            .map(|(row, out)| run(row, out))
            .collect()
    };
    let lse = lse
        .into_iter()
        .map(|l| l.unwrap_or(f32::NEG_INFINITY))
        .collect();
    (out, lse)
}

/// The upstream gradient and the forward's results of one backward call.
#[derive(Debug, Clone, Copy)]
pub struct AttentionSaved<'a> {
    /// The forward's output, rounded to the dtype and read back as f32.
    pub out: &'a [f32],
    /// The forward's `lse`.
    pub lse: &'a [f32],
    /// `dOut`.
    pub grad: &'a [f32],
}

/// One (query, key) pair of the backward: `(p, ds)`.
fn pair(q_scaled: &[f32], k: &[f32], v: &[f32], g: &[f32], lse: f32, delta: f32) -> (f32, f32) {
    let p = exp_p(dot(q_scaled, k) - lse);
    let dp = dot(g, v);
    (p, p * (dp - delta))
}

/// Backward: `(dQuery, dKey, dValue)`, f32, in the layouts of the inputs.
pub fn attention_backward(
    shape: &AttentionShape,
    query: &[f32],
    key: &[f32],
    value: &[f32],
    kv_lens: &[usize],
    saved: AttentionSaved<'_>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let d = shape.head_dim;
    let s = shape;
    // Per query row: `Some((visible, δ))` when it takes part (position ≥ 0, dOut not all zero).
    let active: Vec<Option<(usize, f32)>> = (0..s.batch * s.heads * s.q_len)
        .into_par_iter()
        .map(|row| {
            let (bh, i) = (row / s.q_len, row % s.q_len);
            let visible = s.visible(kv_lens[bh / s.heads], i)?;
            let g = &saved.grad[row * d..][..d];
            if g.iter().all(|&x| x == 0.0) {
                return None;
            }
            Some((visible, dot(g, &saved.out[row * d..][..d])))
        })
        .collect();
    let mut dq = vec![0.0f32; query.len()];
    dq.par_chunks_mut(d.max(1))
        .enumerate()
        .for_each(|(row, dq)| {
            let Some((visible, delta)) = active[row] else {
                return;
            };
            let (bh, i) = (row / s.q_len, row % s.q_len);
            let (b, h) = (bh / s.heads, bh % s.heads);
            let q = scaled(&query[s.q_at(b, h, i)..][..d], s.scale);
            let g = &saved.grad[row * d..][..d];
            for j in 0..visible {
                let at = s.kv_at(b, s.kv_head(h), j);
                let (k, v) = (&key[at..at + d], &value[at..at + d]);
                let (_, ds) = pair(&q, k, v, g, saved.lse[row], delta);
                for (acc, &kj) in dq.iter_mut().zip(k) {
                    *acc = ds.mul_add(kj, *acc);
                }
            }
            dq.iter_mut().for_each(|x| *x *= s.scale);
        });
    let mut dk = vec![0.0f32; key.len()];
    let mut dv = vec![0.0f32; value.len()];
    let group = s.heads / s.kv_heads;
    dk.par_chunks_mut(d.max(1))
        .zip(dv.par_chunks_mut(d.max(1)))
        .enumerate()
        .for_each(|(krow, (dk, dv))| {
            let (bkh, j) = (krow / s.kv_len, krow % s.kv_len);
            let (b, kh) = (bkh / s.kv_heads, bkh % s.kv_heads);
            let (k, v) = (&key[krow * d..][..d], &value[krow * d..][..d]);
            for h in kh * group..(kh + 1) * group {
                for i in 0..s.q_len {
                    let row = (b * s.heads + h) * s.q_len + i;
                    let Some((visible, delta)) = active[row] else {
                        continue;
                    };
                    if j >= visible {
                        continue;
                    }
                    let q = scaled(&query[s.q_at(b, h, i)..][..d], s.scale);
                    let g = &saved.grad[row * d..][..d];
                    let (p, ds) = pair(&q, k, v, g, saved.lse[row], delta);
                    for t in 0..d {
                        dv[t] = p.mul_add(g[t], dv[t]);
                        dk[t] = ds.mul_add(q[t], dk[t]);
                    }
                }
            }
        });
    (dq, dk, dv)
}
