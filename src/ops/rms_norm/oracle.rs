//! The Reference arithmetic of `rms_norm` on host f32 slices (docs/CONTRACT.md, *rms_norm
//! semantics*): the exact operations the CubeCl kernels run.
use rayon::prelude::*;

/// Lanes of the per-row sums: lane `t` takes `d = t, t + LANES, …`, then a pairwise tree.
pub const RMS_NORM_LANES: usize = 256;
/// Rows of one `dGamma` block.
pub const RMS_NORM_ROW_BLOCK: usize = 32;

/// `Σ_d a_d·b_d` in the contract's lane order.
fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; RMS_NORM_LANES];
    for (d, (&x, &y)) in a.iter().zip(b).enumerate() {
        let lane = &mut lanes[d % RMS_NORM_LANES];
        *lane = x.mul_add(y, *lane);
    }
    let mut width = RMS_NORM_LANES / 2;
    while width > 0 {
        for t in 0..width {
            lanes[t] += lanes[t + width];
        }
        width /= 2;
    }
    lanes[0]
}

/// `1 / sqrt(ss / D + eps)` of one row.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    1.0 / (lane_dot(x, x) / x.len() as f32 + eps).sqrt()
}

/// Forward over `x [N, D]`: `y [N, D]` f32 (before the dtype rounding).
pub fn rms_norm_forward(x: &[f32], gamma: &[f32], eps: f32) -> Vec<f32> {
    let d = gamma.len();
    let mut y = vec![0.0f32; x.len()];
    if d == 0 {
        return y;
    }
    y.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(y, x)| {
        let r = inv_rms(x, eps);
        for ((dst, &xv), &g) in y.iter_mut().zip(x).zip(gamma) {
            *dst = (xv * r) * g;
        }
    });
    y
}

/// Backward: `(dX [N, D], dGamma [D])`, f32.
pub fn rms_norm_backward(x: &[f32], gamma: &[f32], grad: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let d = gamma.len();
    let mut dx = vec![0.0f32; x.len()];
    if d == 0 {
        return (dx, Vec::new());
    }
    let n = x.len() / d;
    dx.par_chunks_mut(d)
        .zip(x.par_chunks(d).zip(grad.par_chunks(d)))
        .for_each(|(dx, (x, dy))| {
            let r = inv_rms(x, eps);
            let g: Vec<f32> = dy.iter().zip(gamma).map(|(&a, &b)| a * b).collect();
            let c = ((r * r) * r) * lane_dot(&g, x) / d as f32;
            for ((dst, &xv), &gv) in dx.iter_mut().zip(x).zip(&g) {
                *dst = (-xv).mul_add(c, r * gv);
            }
        });
    let r: Vec<f32> = x.par_chunks(d).map(|x| inv_rms(x, eps)).collect();
    let dgamma = (0..d)
        .into_par_iter()
        .map(|col| {
            let mut total = 0.0f32;
            for start in (0..n).step_by(RMS_NORM_ROW_BLOCK) {
                let mut part = 0.0f32;
                for row in start..n.min(start + RMS_NORM_ROW_BLOCK) {
                    let dy = grad[row * d + col];
                    if dy != 0.0 {
                        part = dy.mul_add(x[row * d + col] * r[row], part);
                    }
                }
                if part != 0.0 {
                    total += part;
                }
            }
            total
        })
        .collect();
    (dx, dgamma)
}
