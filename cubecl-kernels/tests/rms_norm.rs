//! rms_norm tests (wgpu; CUDA too with `--features cuda`): values and gradients against f64 math,
//! and bitwise properties (row invariance, reruns, appended zero-gradient rows, layouts, and the
//! f32 kernels equal to a CPU mirror of the Reference).

mod common;

use burn_invariant_cubecl::rms_norm::{
    tree_plane, with_forward_rows, with_general_one_pass, with_row_kernels, with_two_pass_backward,
};
use burn_invariant_cubecl::{
    FloatDType, KernelError, RmsNormGradRefs, RmsNormRefs, rms_norm_backward,
    rms_norm_backward_workspace_len, rms_norm_forward, rms_norm_limits,
};
use common::*;
use cubecl::prelude::*;

const EPS: f32 = 1e-5;

fn fdt(dt: Dt) -> FloatDType {
    match dt {
        Dt::F32 => FloatDType::F32,
        Dt::F16 => FloatDType::F16,
        Dt::BF16 => FloatDType::BF16,
    }
}

/// Forward of `x` (a `[n, d]` view) and dense `gamma` into a strided output, read back as
/// `[n, d]`.
fn forward_view<R: Runtime>(
    client: &ComputeClient<R>,
    x: &Buf<R>,
    gamma: &Buf<R>,
    [n, d]: [usize; 2],
    dt: Dt,
) -> Vec<f32> {
    let out = alloc(client, &[n, d], &[d + 3, 1], dt);
    forward_into(client, (x, gamma), &out, [n, d], dt)
}

/// Forward of `x` and `gamma` into `out`, read back as `[n, d]`.
fn forward_into<R: Runtime>(
    client: &ComputeClient<R>,
    (x, gamma): (&Buf<R>, &Buf<R>),
    out: &Buf<R>,
    [n, d]: [usize; 2],
    dt: Dt,
) -> Vec<f32> {
    let inputs = RmsNormRefs {
        x: x.b(),
        gamma: gamma.b(),
        dtype: fdt(dt),
        eps: EPS,
    };
    rms_norm_forward(client, &inputs, out.b()).expect("rms_norm_forward");
    read_2d(client, out, dt, n, d)
}

/// Forward of dense `x` and `gamma` into a strided output (element by element).
fn forward<R: Runtime>(
    client: &ComputeClient<R>,
    (x, gamma): (&[f32], &[f32]),
    n: usize,
    dt: Dt,
) -> Vec<f32> {
    forward_to(client, (x, gamma), n, dt, false)
}

/// Forward of dense `x` and `gamma` into a dense output where `dense` (so that the host may take
/// its widest vectors), else into a strided one (element by element).
fn forward_to<R: Runtime>(
    client: &ComputeClient<R>,
    (x, gamma): (&[f32], &[f32]),
    n: usize,
    dt: Dt,
    dense: bool,
) -> Vec<f32> {
    let d = gamma.len();
    let xb = upload(client, x, &[n, d], dt);
    let gb = upload(client, gamma, &[d], dt);
    if dense {
        let out = alloc_dense(client, &[n, d], dt);
        forward_into(client, (&xb, &gb), &out, [n, d], dt)
    } else {
        forward_view(client, &xb, &gb, [n, d], dt)
    }
}

/// `(dx, dgamma)` for dense inputs.
fn backward<R: Runtime>(
    client: &ComputeClient<R>,
    (x, gamma, dy): (&[f32], &[f32], &[f32]),
    n: usize,
    dt: Dt,
) -> (Vec<f32>, Vec<f32>) {
    let d = gamma.len();
    let xb = upload(client, x, &[n, d], dt);
    let gb = upload(client, gamma, &[d], dt);
    let dyb = upload(client, dy, &[n, d], dt);
    backward_bufs(client, (&xb, &gb, &dyb), [n, d], dt)
}

fn backward_bufs<R: Runtime>(
    client: &ComputeClient<R>,
    (x, gamma, dy): (&Buf<R>, &Buf<R>, &Buf<R>),
    [n, d]: [usize; 2],
    dt: Dt,
) -> (Vec<f32>, Vec<f32>) {
    let dx = alloc_dense(client, &[n, d], dt);
    let dg = alloc_dense(client, &[d], dt);
    let ws = alloc_dense(client, &[rms_norm_backward_workspace_len(n, d)], Dt::F32);
    let inputs = RmsNormRefs {
        x: x.b(),
        gamma: gamma.b(),
        dtype: fdt(dt),
        eps: EPS,
    };
    let grads = RmsNormGradRefs {
        grad_out: dy.b(),
        grad_x: dx.b(),
        grad_gamma: dg.b(),
        workspace: ws.b(),
    };
    rms_norm_backward(client, &inputs, &grads).expect("rms_norm_backward");
    (
        read_2d(client, &dx, dt, n, d),
        read_2d(client, &dg, dt, d, 1),
    )
}

/// The Reference's f32 arithmetic (`src/ops/rms_norm/oracle.rs`), for the bitwise checks.
mod mirror {
    use burn_invariant_cubecl::RMS_NORM_ROW_BLOCK;

    fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
        let mut l = [0.0f32; 256];
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            l[i % 256] = x.mul_add(*y, l[i % 256]);
        }
        for s in [128, 64, 32, 16, 8, 4, 2, 1] {
            for t in 0..s {
                l[t] += l[t + s];
            }
        }
        l[0]
    }

    fn inv_rms(x: &[f32], eps: f32) -> f32 {
        1.0 / (lane_dot(x, x) / x.len() as f32 + eps).sqrt()
    }

    pub fn forward(x: &[f32], gamma: &[f32], eps: f32) -> Vec<f32> {
        let d = gamma.len();
        x.chunks(d)
            .flat_map(|x| {
                let r = inv_rms(x, eps);
                x.iter().zip(gamma).map(move |(&v, &g)| (v * r) * g)
            })
            .collect()
    }

    pub fn backward(x: &[f32], gamma: &[f32], dy: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
        let d = gamma.len();
        let r: Vec<f32> = x.chunks(d).map(|x| inv_rms(x, eps)).collect();
        let mut dx = Vec::with_capacity(x.len());
        for ((x, dy), &r) in x.chunks(d).zip(dy.chunks(d)).zip(&r) {
            let g: Vec<f32> = dy.iter().zip(gamma).map(|(a, b)| a * b).collect();
            let c = ((r * r) * r) * lane_dot(&g, x) / d as f32;
            dx.extend(x.iter().zip(&g).map(|(&v, &g)| (-v).mul_add(c, r * g)));
        }
        let n = r.len();
        let dgamma = (0..d)
            .map(|col| {
                let mut total = 0.0f32;
                for start in (0..n).step_by(RMS_NORM_ROW_BLOCK) {
                    let mut part = 0.0f32;
                    for row in start..n.min(start + RMS_NORM_ROW_BLOCK) {
                        let g = dy[row * d + col];
                        if g != 0.0 {
                            part = g.mul_add(x[row * d + col] * r[row], part);
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
}

/// f64 math on the (already rounded) inputs: `(y, dx, dgamma)` and their magnitudes
/// (`|x·r·γ|`, `|r·g| + |x|·r³·Σ|g·x|/D`, `Σ|dy·x·r|`).
#[allow(clippy::type_complexity)]
fn exact(x: &[f32], gamma: &[f32], dy: &[f32]) -> ([Vec<f64>; 3], [Vec<f64>; 3]) {
    let d = gamma.len();
    let n = x.len() / d;
    let (mut y, mut ym, mut dx, mut dxm) = (vec![], vec![], vec![], vec![]);
    let (mut dg, mut dgm) = (vec![0.0; d], vec![0.0; d]);
    for i in 0..n {
        let x = &x[i * d..(i + 1) * d];
        let dy = &dy[i * d..(i + 1) * d];
        let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
        let r = 1.0 / (ss / d as f64 + EPS as f64).sqrt();
        let g: Vec<f64> = dy
            .iter()
            .zip(gamma)
            .map(|(&a, &b)| a as f64 * b as f64)
            .collect();
        let dot: f64 = g.iter().zip(x).map(|(g, &v)| g * v as f64).sum();
        let adot: f64 = g.iter().zip(x).map(|(g, &v)| (g * v as f64).abs()).sum();
        for j in 0..d {
            let xv = x[j] as f64;
            y.push(xv * r * gamma[j] as f64);
            ym.push((xv * r * gamma[j] as f64).abs());
            dx.push(r * g[j] - xv * r * r * r * dot / d as f64);
            dxm.push((r * g[j]).abs() + xv.abs() * r * r * r * adot / d as f64);
            dg[j] += dy[j] as f64 * xv * r;
            dgm[j] += (dy[j] as f64 * xv * r).abs();
        }
    }
    ([y, dx, dg], [ym, dxm, dgm])
}

/// `|got − want| ≤ acc·mag + out·|want| + tiny`: `acc` covers the f32 sums (relative to the
/// magnitude of their terms), `out` and `tiny` the one rounding to the output dtype.
fn check(what: &str, got: &[f32], want: &[f64], mag: &[f64], acc: f64, dt: Dt) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    // Relative rounding, and the spacing of the dtype's subnormals.
    let (out, tiny) = match dt {
        Dt::F32 => (f32::EPSILON as f64, 1e-44),
        Dt::F16 => (1.0 / 1024.0, 6e-8),
        Dt::BF16 => (1.0 / 128.0, 1e-38),
    };
    for i in 0..got.len() {
        let err = (got[i] as f64 - want[i]).abs();
        let tol = acc * mag[i] + out * want[i].abs() + tiny;
        assert!(
            err <= tol,
            "{what}: element {i}: got {} want {} (err {err:e}, tol {tol:e})",
            got[i],
            want[i]
        );
    }
}

fn values_and_gradients<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    let u = f32::EPSILON as f64;
    for &d in &[1usize, 100, 257, 600, 4100] {
        for &n in &[1usize, 5, 300] {
            let seed = (n * 10_000 + d) as u64;
            let x = rand_vec(seed, n * d, dt);
            let gamma: Vec<f32> = rand_vec(seed + 1, d, dt)
                .iter()
                .map(|v| dt.round(1.0 + v))
                .collect();
            let dy = rand_vec(seed + 2, n * d, dt);
            let ([y, dx, dg], [ym, dxm, dgm]) = exact(&x, &gamma, &dy);
            let row_acc = u * ((d / 256) as f64 + 16.0);
            let got = forward(client, (&x, &gamma), n, dt);
            check(&format!("{dt:?} y n={n} d={d}"), &got, &y, &ym, row_acc, dt);
            let (gdx, gdg) = backward(client, (&x, &gamma, &dy), n, dt);
            let tag = format!("{dt:?} n={n} d={d}");
            check(&format!("dx {tag}"), &gdx, &dx, &dxm, 4.0 * row_acc, dt);
            let col_acc = u * (n.min(256) as f64 + (n / 256) as f64 + 8.0) + row_acc;
            check(&format!("dgamma {tag}"), &gdg, &dg, &dgm, col_acc, dt);
        }
    }
    eprintln!(
        "[{}] rms_norm {dt:?} values and gradients vs f64: 15 shapes PASS",
        runtime_name(client)
    );
}

fn data(n: usize, d: usize, dt: Dt) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let x = rand_vec(n as u64 * 31 + d as u64, n * d, dt);
    let gamma = rand_vec(d as u64 + 5, d, dt);
    let dy = rand_vec(n as u64 * 7 + d as u64 + 9, n * d, dt);
    (x, gamma, dy)
}

/// f32: the kernels equal the CPU mirror of the Reference bitwise (several blocks, a partial
/// block, rows longer than the lanes, and N past wgpu's 65535 cubes per launch).
fn equals_reference<R: Runtime>(client: &ComputeClient<R>) {
    for &(n, d) in &[
        (300usize, 4100usize),
        (513, 257),
        (3, 1),
        (70_000, 1),
        (1, 70_000),
    ] {
        let (x, gamma, dy) = data(n, d, Dt::F32);
        let y = forward(client, (&x, &gamma), n, Dt::F32);
        assert_eq!(
            bits(&y),
            bits(&mirror::forward(&x, &gamma, EPS)),
            "y n={n} d={d}"
        );
        let (dx, dg) = backward(client, (&x, &gamma, &dy), n, Dt::F32);
        let (wdx, wdg) = mirror::backward(&x, &gamma, &dy, EPS);
        assert_eq!(bits(&dx), bits(&wdx), "dx n={n} d={d}");
        assert_eq!(bits(&dg), bits(&wdg), "dgamma n={n} d={d}");
    }
    eprintln!(
        "[{}] rms_norm f32 forward, dx, dgamma == Reference mirror bitwise: PASS",
        runtime_name(client)
    );
}

/// The one-pass backward (rows that fit its registers) and the two-pass kernels give the same
/// bits, and the lane trees through plane shuffles give the shared-memory trees' bits (forward
/// too): the vector widths the one pass picks (D = 600 keeps the widest, 4100 and 8192 narrow
/// it), rounds padded to a power of two (4100), whole rounds at fixed offsets (4096 with
/// narrowed vectors, 8192, 256) against the general addressing, a partial last row block, and a
/// transposed `x`.
fn one_pass_equals_two_passes<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    let planes = tree_plane(client) > 0;
    for &(n, d) in &[
        (300usize, 600usize),
        (70, 4100),
        (40, 4096),
        (33, 8192),
        (1, 256),
    ] {
        let (x, gamma, dy) = data(n, d, dt);
        let one = backward(client, (&x, &gamma, &dy), n, dt);
        let two = with_two_pass_backward(|| backward(client, (&x, &gamma, &dy), n, dt));
        assert_eq!(bits(&one.0), bits(&two.0), "{dt:?} dx n={n} d={d}");
        assert_eq!(bits(&one.1), bits(&two.1), "{dt:?} dgamma n={n} d={d}");
        // Whole rounds (4096, 8192, 256) take fixed offsets by default: the general addressing's
        // bits.
        let general = with_general_one_pass(|| backward(client, (&x, &gamma, &dy), n, dt));
        assert_eq!(
            (bits(&general.0), bits(&general.1)),
            (bits(&one.0), bits(&one.1)),
            "{dt:?} general one-pass addressing n={n} d={d}"
        );
        // The forward's widths and batches (rows re-read past one batch), into a dense output:
        // the same bits as the host's choice there and as element by element (the strided
        // output of `forward`).
        let y = forward(client, (&x, &gamma), n, dt);
        let y_dense = forward_to(client, (&x, &gamma), n, dt, true);
        assert_eq!(
            bits(&y_dense),
            bits(&y),
            "{dt:?} forward, dense output n={n} d={d}"
        );
        for (width, batch) in [(8usize, 1usize), (8, 3), (4, 2), (2, 3), (1, usize::MAX)] {
            let y_other = with_forward_rows(width, batch, || {
                forward_to(client, (&x, &gamma), n, dt, true)
            });
            assert_eq!(
                bits(&y_other),
                bits(&y),
                "{dt:?} forward, vectors of {width}, batches of {batch} n={n} d={d}"
            );
        }
        if planes {
            // The lane trees in shared memory: the same bits as through planes.
            let plain = with_row_kernels(usize::MAX, false, || {
                backward(client, (&x, &gamma, &dy), n, dt)
            });
            assert_eq!(
                (bits(&plain.0), bits(&plain.1)),
                (bits(&one.0), bits(&one.1)),
                "{dt:?} backward, shared-memory tree n={n} d={d}"
            );
            let y_plain =
                with_row_kernels(usize::MAX, false, || forward(client, (&x, &gamma), n, dt));
            assert_eq!(
                bits(&y_plain),
                bits(&y),
                "{dt:?} forward, shared-memory tree n={n} d={d}"
            );
        }
        let (xt, gb, dyb) = (
            upload_transposed_view(client, &x, n, d, dt),
            upload(client, &gamma, &[d], dt),
            upload(client, &dy, &[n, d], dt),
        );
        let strided = backward_bufs(client, (&xt, &gb, &dyb), [n, d], dt);
        assert_eq!(
            (bits(&strided.0), bits(&strided.1)),
            (bits(&one.0), bits(&one.1)),
            "{dt:?} transposed x n={n} d={d}"
        );
    }
    let trees = if planes {
        "plane trees == shared-memory trees"
    } else {
        "no plane trees here (not compared)"
    };
    eprintln!(
        "[{}] rms_norm {dt:?} one-pass backward == two-pass, {trees}, bitwise: PASS",
        runtime_name(client)
    );
}

/// Rows alone equal rows among others (forward and dx), reruns are identical, appended
/// zero-gradient rows (with NaN in x) leave dgamma unchanged, and strided views give the dense
/// bits.
fn invariance<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    let (n, d) = (300usize, 600usize);
    let (x, gamma, dy) = data(n, d, dt);
    let y = forward(client, (&x, &gamma), n, dt);
    let (dx, dg) = backward(client, (&x, &gamma, &dy), n, dt);
    assert_eq!(
        bits(&y),
        bits(&forward(client, (&x, &gamma), n, dt)),
        "rerun y"
    );
    let (dx2, dg2) = backward(client, (&x, &gamma, &dy), n, dt);
    assert_eq!(
        (bits(&dx), bits(&dg)),
        (bits(&dx2), bits(&dg2)),
        "rerun grads"
    );
    for &i in &[0usize, 1, 255, 256, 299] {
        let rows = i * d..(i + 1) * d;
        let alone = forward(client, (&x[rows.clone()], &gamma), 1, dt);
        assert_eq!(bits(&alone), bits(&y[rows.clone()]), "y row {i} alone");
        let (dx1, _) = backward(client, (&x[rows.clone()], &gamma, &dy[rows.clone()]), 1, dt);
        assert_eq!(bits(&dx1), bits(&dx[rows]), "dx row {i} alone");
    }
    for extra in [1usize, 212, 300] {
        let mut xp = x.clone();
        xp.extend(std::iter::repeat_n(f32::NAN, extra * d));
        let mut dyp = dy.clone();
        dyp.extend(std::iter::repeat_n(0.0, extra * d));
        let (dxp, dgp) = backward(client, (&xp, &gamma, &dyp), n + extra, dt);
        assert_eq!(
            bits(&dgp),
            bits(&dg),
            "dgamma with {extra} zero-gradient NaN rows"
        );
        assert_eq!(
            bits(&dxp[..n * d]),
            bits(&dx),
            "dx with {extra} appended rows"
        );
    }
    // x as a transposed view, gamma with stride 2, dy row-padded: the dense bits.
    let xt = upload_transposed_view(client, &x, n, d, dt);
    let mut g2 = vec![f32::NAN; 2 * d];
    for (j, &g) in gamma.iter().enumerate() {
        g2[2 * j] = g;
    }
    let gh = upload(client, &g2, &[2 * d], dt);
    let gs = Buf {
        binding: view(&gh.handle, &[d], &[2]),
        handle: gh.handle,
        dt_size: dt.size(),
    };
    assert_eq!(
        bits(&forward_view(client, &xt, &gs, [n, d], dt)),
        bits(&y),
        "strided y"
    );
    let dyp = upload_row_padded(client, &dy, n, d, d + 5, dt);
    let (sdx, sdg) = backward_bufs(client, (&xt, &gs, &dyp), [n, d], dt);
    assert_eq!(
        (bits(&sdx), bits(&sdg)),
        (bits(&dx), bits(&dg)),
        "strided grads"
    );
    eprintln!(
        "[{}] rms_norm {dt:?} row invariance, reruns, appended zero-gradient rows, strides: PASS",
        runtime_name(client)
    );
}

/// Zero sizes run nothing invalid (N = 0: dgamma zeros); bad arguments are refused up front.
fn edges<R: Runtime>(client: &ComputeClient<R>) {
    let dt = Dt::F32;
    let y = forward(client, (&[], &[1.0, 2.0]), 0, dt);
    assert!(y.is_empty());
    let (dx, dg) = backward(client, (&[], &[1.0, 2.0, 3.0], &[]), 0, dt);
    assert!(dx.is_empty());
    assert_eq!(bits(&dg), bits(&[0.0; 3]), "N = 0: dgamma zeros");
    assert!(forward(client, (&[], &[]), 4, dt).is_empty());
    let (dx, dg) = backward(client, (&[], &[], &[]), 4, dt);
    assert!(dx.is_empty() && dg.is_empty());

    let (n, d) = (300usize, 8usize);
    let x = upload(client, &rand_vec(1, n * d, dt), &[n, d], dt);
    let g = upload(client, &rand_vec(2, d, dt), &[d], dt);
    let g_bad = upload(client, &rand_vec(2, d + 1, dt), &[d + 1], dt);
    let out = alloc_dense(client, &[n, d], dt);
    fn inputs<'a, R: Runtime>(x: &'a Buf<R>, gamma: &'a Buf<R>) -> RmsNormRefs<'a, R> {
        RmsNormRefs {
            x: x.b(),
            gamma: gamma.b(),
            dtype: FloatDType::F32,
            eps: EPS,
        }
    }
    let e = rms_norm_forward(client, &inputs(&x, &g_bad), out.b()).unwrap_err();
    assert!(matches!(e, KernelError::Shape { arg: "gamma", .. }), "{e}");
    let ws = alloc_dense(
        client,
        &[rms_norm_backward_workspace_len(n, d) - 1],
        Dt::F32,
    );
    let grads = RmsNormGradRefs {
        grad_out: x.b(),
        grad_x: out.b(),
        grad_gamma: g.b(),
        workspace: ws.b(),
    };
    let e = rms_norm_backward(client, &inputs(&x, &g), &grads).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::BufferTooSmall {
                arg: "workspace",
                ..
            }
        ),
        "{e}"
    );
    let e = rms_norm_limits(client, 1 << 16, 1 << 15).unwrap_err();
    assert!(
        matches!(e, KernelError::IndexOverflow { arg: "x", .. }),
        "{e}"
    );
    rms_norm_limits(client, 1 << 16, (1 << 15) - 8).expect("within limits");
    eprintln!(
        "[{}] rms_norm zero sizes and errors: PASS",
        runtime_name(client)
    );
}

#[test]
fn rms_norm_values_wgpu() {
    with_wgpu("rms_norm_values_wgpu", |client| {
        values_and_gradients(client, Dt::F32);
        values_and_gradients(client, Dt::F16);
    });
}

#[test]
fn rms_norm_bitwise_wgpu() {
    with_wgpu("rms_norm_bitwise_wgpu", |client| {
        equals_reference(client);
        invariance(client, Dt::F32);
        invariance(client, Dt::F16);
        one_pass_equals_two_passes(client, Dt::F32);
        one_pass_equals_two_passes(client, Dt::F16);
    });
}

#[test]
fn rms_norm_edges_wgpu() {
    with_wgpu("rms_norm_edges_wgpu", edges);
}

#[cfg(feature = "cuda")]
#[test]
fn rms_norm_cuda() {
    with_cuda(|client| {
        for dt in [Dt::F32, Dt::F16, Dt::BF16] {
            values_and_gradients(client, dt);
            invariance(client, dt);
            one_pass_equals_two_passes(client, dt);
        }
        equals_reference(client);
        edges(client);
    });
}

/// Forward + backward of `[16384, 4096]` bf16 (`--ignored --nocapture`): effective bandwidth from
/// the bytes each must move (forward: x, y; backward: x, dy, dx).
#[cfg(feature = "cuda")]
#[test]
#[ignore]
fn rms_norm_perf_cuda() {
    with_cuda(|client| {
        let (n, d, dt) = (16384usize, 4096usize, Dt::BF16);
        let (x, gamma, dy) = data(n, d, dt);
        let (xb, gb, dyb) = (
            upload(client, &x, &[n, d], dt),
            upload(client, &gamma, &[d], dt),
            upload(client, &dy, &[n, d], dt),
        );
        let (out, dx, dg) = (
            alloc_dense(client, &[n, d], dt),
            alloc_dense(client, &[n, d], dt),
            alloc_dense(client, &[d], dt),
        );
        let ws = alloc_dense(client, &[rms_norm_backward_workspace_len(n, d)], Dt::F32);
        let inputs = RmsNormRefs {
            x: xb.b(),
            gamma: gb.b(),
            dtype: FloatDType::BF16,
            eps: EPS,
        };
        let grads = RmsNormGradRefs {
            grad_out: dyb.b(),
            grad_x: dx.b(),
            grad_gamma: dg.b(),
            workspace: ws.b(),
        };
        let sync = || cubecl::future::block_on(client.sync()).unwrap();
        let time = |f: &dyn Fn()| {
            f();
            sync();
            let mut s: Vec<f64> = (0..7)
                .map(|_| {
                    let t = std::time::Instant::now();
                    for _ in 0..20 {
                        f();
                    }
                    sync();
                    t.elapsed().as_secs_f64() / 20.0
                })
                .collect();
            s.sort_by(f64::total_cmp);
            s[3]
        };
        let fwd = time(&|| rms_norm_forward(client, &inputs, out.b()).unwrap());
        for (width, batch) in [(4usize, 8usize), (4, 4), (8, 8), (8, 4), (2, 16), (2, 8)] {
            let t = time(&|| {
                with_forward_rows(width, batch, || {
                    rms_norm_forward(client, &inputs, out.b()).unwrap()
                })
            });
            println!(
                "RESULT rms_norm bf16 [{n}, {d}]: forward, vectors of {width}, batches of \
                 {batch}: {:.1} us",
                t * 1e6
            );
        }
        let fwd_shared = time(&|| {
            with_row_kernels(usize::MAX, false, || {
                rms_norm_forward(client, &inputs, out.b()).unwrap()
            })
        });
        println!(
            "RESULT rms_norm bf16 [{n}, {d}]: forward, lane tree in shared memory: {:.1} us",
            fwd_shared * 1e6
        );
        let bwd = time(&|| rms_norm_backward(client, &inputs, &grads).unwrap());
        let general =
            time(&|| with_general_one_pass(|| rms_norm_backward(client, &inputs, &grads).unwrap()));
        println!(
            "RESULT rms_norm bf16 [{n}, {d}]: one-pass backward, general addressing and width: \
             {:.1} us (fixed offsets: {:.1} us)",
            general * 1e6,
            bwd * 1e6
        );
        let two = time(&|| {
            with_two_pass_backward(|| rms_norm_backward(client, &inputs, &grads).unwrap())
        });
        // The one-pass kernel at each vector width, its lane tree through plane shuffles and in
        // shared memory.
        for (width, plane) in [(4usize, true), (4, false), (2, true), (2, false)] {
            let t = time(&|| {
                with_row_kernels(width, plane, || {
                    rms_norm_backward(client, &inputs, &grads).unwrap()
                })
            });
            println!(
                "RESULT rms_norm bf16 [{n}, {d}]: one-pass backward, vectors of {width}, \
                 plane tree {plane}: {:.1} us",
                t * 1e6
            );
        }
        let elems = (n * d * dt.size()) as f64;
        let gbs = |bytes: f64, s: f64| bytes / s / 1e9;
        println!(
            "RESULT rms_norm bf16 [{n}, {d}]: forward {:.1} us ({:.0} GB/s), backward {:.1} us \
             ({:.0} GB/s), both {:.1} us ({:.0} GB/s); two-pass backward {:.1} us ({:.0} GB/s)",
            fwd * 1e6,
            gbs(2.0 * elems, fwd),
            bwd * 1e6,
            gbs(3.0 * elems, bwd),
            (fwd + bwd) * 1e6,
            gbs(5.0 * elems, fwd + bwd),
            two * 1e6,
            gbs(3.0 * elems, two)
        );
    });
}
