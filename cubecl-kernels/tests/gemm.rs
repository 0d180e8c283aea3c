//! GEMM, row-reduction GEMM and col_sum tests (wgpu; CUDA too with `--features cuda`).

mod common;

use burn_invariant_cubecl::{
    GemmPath, KernelError, col_sum, matmul, matmul_path, matmul_row_reduction,
};
use common::*;
use cubecl::prelude::*;

/// `a [m, k] · b [k, n] (+ bias)` in `dt`, read back as f32, and the path that ran.
fn gemm_run<R: Runtime>(
    client: &ComputeClient<R>,
    (a, b, bias): (&[f32], &[f32], Option<&[f32]>),
    [m, k, n]: [usize; 3],
    dt: Dt,
) -> (Vec<f32>, GemmPath) {
    let ab = upload(client, a, &[m, k], dt);
    let bb = upload(client, b, &[k, n], dt);
    let biasb = bias.map(|x| upload(client, x, &[n], dt));
    let out = alloc_dense(client, &[m, n], dt);
    let path = matmul(
        client,
        ab.b(),
        bb.b(),
        biasb.as_ref().map(|x| x.b()),
        out.b(),
        dt.storage(),
    )
    .expect("matmul");
    (read_2d(client, &out, dt, m, n), path)
}

fn correctness<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    let mut cases = 0;
    for &m in &[1usize, 7, 67] {
        for &k in &[1usize, 31, 129] {
            for &n in &[1usize, 33, 255] {
                let a = rand_vec((m * 1000 + k * 10 + n) as u64, m * k, dt);
                let b = rand_vec((n * 1000 + k) as u64 + 7, k * n, dt);
                let bias = rand_vec(n as u64 + 99, n, dt);
                let use_bias = (m + k + n) % 2 == 1;
                let biasr = use_bias.then_some(bias.as_slice());
                let (got, _) = gemm_run(client, (&a, &b, biasr), [m, k, n], dt);
                let (want, mag) = gemm_f64(&a, &b, biasr, m, k, n);
                assert_close(
                    &format!("{dt:?} m={m} k={k} n={n} bias={use_bias}"),
                    &got,
                    &want,
                    &mag,
                    dt,
                    k,
                );
                cases += 1;
            }
        }
    }
    eprintln!(
        "[{}] gemm {dt:?} correctness vs f64: {cases} shapes PASS",
        runtime_name(client)
    );
}

fn row_invariance<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    let (m, k, n) = (67usize, 129usize, 255usize);
    let a = rand_vec(1, m * k, dt);
    let b = rand_vec(2, k * n, dt);
    let bias = rand_vec(3, n, dt);
    let (full, _) = gemm_run(client, (&a, &b, Some(&bias)), [m, k, n], dt);
    // Rerun determinism.
    let (again, _) = gemm_run(client, (&a, &b, Some(&bias)), [m, k, n], dt);
    assert_eq!(bits(&full), bits(&again), "rerun determinism");
    // Single rows.
    for &i in &[0usize, 1, 33, 63, 64, 66] {
        let (row, _) = gemm_run(
            client,
            (&a[i * k..(i + 1) * k], &b, Some(&bias)),
            [1, k, n],
            dt,
        );
        assert_eq!(
            bits(&row),
            bits(&full[i * n..(i + 1) * n]),
            "row {i} alone vs in batch"
        );
    }
    // Chunked rows (chunk boundaries not on tile boundaries).
    let mut chunked = Vec::new();
    for (s, e) in [(0usize, 5usize), (5, 50), (50, 67)] {
        let (c, _) = gemm_run(
            client,
            (&a[s * k..e * k], &b, Some(&bias)),
            [e - s, k, n],
            dt,
        );
        chunked.extend(c);
    }
    assert_eq!(bits(&chunked), bits(&full), "chunked rows vs one call");
    // Padded rows: 61 extra rows of garbage appended.
    let mut ap = a.clone();
    ap.extend(rand_vec(77, 61 * k, dt).iter().map(|x| x * 1000.0));
    let (padded, _) = gemm_run(client, (&ap, &b, Some(&bias)), [m + 61, k, n], dt);
    assert_eq!(bits(&padded[..m * n]), bits(&full), "padded rows");
    eprintln!(
        "[{}] gemm {dt:?} bitwise row invariance (alone/chunked/padded) + rerun: PASS",
        runtime_name(client)
    );
}

fn strided_layouts<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    let (m, k, n) = (37usize, 45usize, 70usize);
    let a = rand_vec(11, m * k, dt);
    let b = rand_vec(12, k * n, dt);
    let (dense, _) = gemm_run(client, (&a, &b, None), [m, k, n], dt);
    let at = upload_transposed_view(client, &a, m, k, dt);
    let bt = upload_transposed_view(client, &b, k, n, dt);
    let out = alloc(client, &[m, n], &[n + 13, 1], dt);
    matmul(client, at.b(), bt.b(), None, out.b(), dt.storage()).expect("strided matmul");
    let got = read_2d(client, &out, dt, m, n);
    let path = matmul_path(client, dt.storage(), k, n).unwrap();
    if path == GemmPath::Fma {
        assert_eq!(
            bits(&got),
            bits(&dense),
            "transposed views + padded out == dense"
        );
    } else {
        let (want, mag) = gemm_f64(&a, &b, None, m, k, n);
        assert_close("strided cmma", &got, &want, &mag, dt, k);
    }
    // The padding between output rows is untouched.
    let raw = read_raw(client, &out, dt);
    for i in 0..m - 1 {
        for j in n..n + 13 {
            assert_eq!(raw[i * (n + 13) + j], -7.25, "out padding overwritten");
        }
    }
    eprintln!(
        "[{}] gemm {dt:?} transposed lhs/rhs views + strided out: PASS",
        runtime_name(client)
    );
}

/// Every staging orientation and global load width gives the same bits: dense, transposed and
/// row-padded operands (the cmma kernel stages each in its own orientation, with 8-wide loads where
/// dense and aligned, scalar loads otherwise), on a shape that spans several blocks and is not a
/// multiple of any tile.
fn layouts_and_load_widths<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    let (m, k, n) = (200usize, 136usize, 264usize);
    let a = rand_vec(41, m * k, dt);
    let b = rand_vec(42, k * n, dt);
    let bias = rand_vec(43, n, dt);
    let bias_buf = upload(client, &bias, &[n], dt);
    let out_of = |lhs: &Buf<R>, rhs: &Buf<R>| {
        let out = alloc_dense(client, &[m, n], dt);
        matmul(
            client,
            lhs.b(),
            rhs.b(),
            Some(bias_buf.b()),
            out.b(),
            dt.storage(),
        )
        .expect("matmul");
        read_2d(client, &out, dt, m, n)
    };
    let lhs = [
        ("dense", upload(client, &a, &[m, k], dt)),
        ("transposed", upload_transposed_view(client, &a, m, k, dt)),
        ("row-padded", upload_row_padded(client, &a, m, k, k + 3, dt)),
    ];
    let rhs = [
        ("dense", upload(client, &b, &[k, n], dt)),
        ("transposed", upload_transposed_view(client, &b, k, n, dt)),
        ("row-padded", upload_row_padded(client, &b, k, n, n + 3, dt)),
    ];
    let want = out_of(&lhs[0].1, &rhs[0].1);
    let (exact, mag) = gemm_f64(&a, &b, Some(&bias), m, k, n);
    assert_close(&format!("{dt:?} layouts"), &want, &exact, &mag, dt, k);
    for (ln, l) in &lhs {
        for (rn, r) in &rhs {
            assert_eq!(
                bits(&out_of(l, r)),
                bits(&want),
                "{dt:?} lhs {ln} x rhs {rn} vs dense x dense"
            );
        }
    }
    // Where the kernel drives the MMAs by hand, WMMA gives the same bits (same MMA steps).
    if let Ok(GemmPath::Cmma {
        manual_mma: true, ..
    }) = matmul_path(client, dt.storage(), k, n)
    {
        for (l, r) in [(0, 0), (1, 1), (2, 0)] {
            let run = |manual: Option<bool>| {
                let out = alloc_dense(client, &[m, n], dt);
                match manual {
                    // `matmul` with no bias takes the manual path here.
                    None => matmul(
                        client,
                        lhs[l].1.b(),
                        rhs[r].1.b(),
                        None,
                        out.b(),
                        dt.storage(),
                    )
                    .map(|_| ()),
                    Some(manual) => burn_invariant_cubecl::gemm::matmul_cmma_tiled(
                        client,
                        lhs[l].1.b(),
                        rhs[r].1.b(),
                        out.b(),
                        dt.storage(),
                        burn_invariant_cubecl::consts::CMMA_TILE,
                        manual,
                    ),
                }
                .unwrap();
                bits(&read_2d(client, &out, dt, m, n))
            };
            assert_eq!(
                run(Some(false)),
                run(None),
                "{dt:?} WMMA vs manual MMA, lhs {} x rhs {}",
                lhs[l].0,
                rhs[r].0
            );
        }
    }
    // A row alone vs in the batch, on the wide-load path.
    for &i in &[0usize, 127, 128, 199] {
        let row = upload(client, &a[i * k..(i + 1) * k], &[1, k], dt);
        let out = alloc_dense(client, &[1, n], dt);
        matmul(
            client,
            row.b(),
            rhs[1].1.b(),
            Some(bias_buf.b()),
            out.b(),
            dt.storage(),
        )
        .unwrap();
        assert_eq!(
            bits(&read_2d(client, &out, dt, 1, n)),
            bits(&want[i * n..(i + 1) * n]),
            "{dt:?} row {i} alone vs in batch"
        );
    }
    eprintln!(
        "[{}] gemm {dt:?} 9 layout pairs and load widths bitwise equal, rows alone: PASS",
        runtime_name(client)
    );
}

/// Where the `cp.async` ring runs (dense, aligned operands on CUDA), every ring depth gives the
/// register-pipelined kernel's bits (row-padded lhs: scalar loads through registers), for K that
/// fills fewer stages than the ring, exactly one ring, and several laps with a partial last stage.
fn ring_depths<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    let Ok(GemmPath::Cmma {
        manual_mma: true,
        async_tile,
        ..
    }) = matmul_path(client, dt.storage(), 64, 64)
    else {
        return;
    };
    let pinned = async_tile.expect("CUDA runs the cp.async ring");
    let (m, n) = (200usize, 264usize);
    for k in [8usize, 24, 96, 136, 200] {
        let a = rand_vec(51 + k as u64, m * k, dt);
        let b = rand_vec(52 + k as u64, k * n, dt);
        let lhs = upload(client, &a, &[m, k], dt);
        let rhs = upload(client, &b, &[k, n], dt);
        let padded = upload_row_padded(client, &a, m, k, k + 3, dt);
        let reg_out = alloc_dense(client, &[m, n], dt);
        matmul(client, padded.b(), rhs.b(), None, reg_out.b(), dt.storage()).unwrap();
        let want = bits(&read_2d(client, &reg_out, dt, m, n));
        let (exact, mag) = gemm_f64(&a, &b, None, m, k, n);
        assert_close(
            &format!("{dt:?} K={k} registers"),
            &read_2d(client, &reg_out, dt, m, n),
            &exact,
            &mag,
            dt,
            k,
        );
        let rings = [
            (2usize, 1usize),
            (3, 1),
            (4, 1),
            (5, 1),
            (3, 2),
            (4, 2),
            (5, 2),
        ]
        .map(|(stages, lag)| burn_invariant_cubecl::gemm::CmmaTile {
            stages,
            lag,
            ..burn_invariant_cubecl::consts::CMMA_TILE
        });
        for tile in rings.into_iter().chain([pinned]) {
            let out = alloc_dense(client, &[m, n], dt);
            burn_invariant_cubecl::gemm::matmul_cmma_tiled(
                client,
                lhs.b(),
                rhs.b(),
                out.b(),
                dt.storage(),
                tile,
                true,
            )
            .unwrap();
            assert_eq!(
                bits(&read_2d(client, &out, dt, m, n)),
                want,
                "{dt:?} K={k}: cp.async {tile:?} vs registers"
            );
        }
    }
    eprintln!(
        "[{}] gemm {dt:?} cp.async rings of 2-5 stages, lag 1 and 2, and the pinned ring == register pipeline, 5 K: PASS",
        runtime_name(client)
    );
}

/// The once-rounded `fma` emulation vs the CPU `f32::mul_add`, bit for bit, on random triples and
/// on the hard cases (cancellation to a few bits, products that are exact ties, signed zeros,
/// infinities; the emulation's documented domain).
/// Asserted where the device needs the emulation; a compiler that contracts `x·y + z` (CUDA)
/// would defeat it, and there the device `fma` is used instead.
fn fma_emulation<R: Runtime>(client: &ComputeClient<R>) {
    let mode = burn_invariant_cubecl::fma_mode(client);
    let mut a = rand_vec(51, 20000, Dt::F32);
    let mut b = rand_vec(52, 20000, Dt::F32);
    let mut c = rand_vec(53, 20000, Dt::F32);
    let t = 1.0f32 + 2f32.powi(-12);
    let hard = [
        (t, t, -1.0),
        (t, -t, 1.0),
        (1.0 + 2f32.powi(-23), 1.0 - 2f32.powi(-23), -1.0),
        (3.0, 1.0 / 3.0, -1.0),
        (0.1, 10.0, -1.0),
        (0.0, -1.0, -0.0),
        (-0.0, 5.0, 0.0),
        (1e-20, 1e-20, 0.0),
        (1e20, 1e20, f32::NEG_INFINITY),
        (f32::INFINITY, 1.0, 2.0),
        (f32::NAN, 1.0, 2.0),
        (1.5, 2f32.powi(-24), 1.0),
    ];
    for (x, y, z) in hard {
        a.push(x);
        b.push(y);
        c.push(z);
    }
    // Products that cancel c to the last bits.
    for i in 0..2000 {
        let x = a[i];
        let y = b[i];
        a.push(x);
        b.push(y);
        c.push(-(x * y));
    }
    let got = burn_invariant_cubecl::gemm::fma_emulated_on_device(client, &a, &b, &c).unwrap();
    let diff: Vec<usize> = (0..a.len())
        .filter(|&i| {
            let want = a[i].mul_add(b[i], c[i]);
            let same_nan = want.is_nan() && got[i].is_nan();
            !same_nan && want.to_bits() != got[i].to_bits()
        })
        .collect();
    eprintln!(
        "[{}] fma mode {mode:?}; emulated fma vs CPU mul_add: {}/{} differ{}",
        runtime_name(client),
        diff.len(),
        a.len(),
        diff.first()
            .map(|&i| format!(
                " (first: fma({:e}, {:e}, {:e}) = {:e}, want {:e})",
                a[i],
                b[i],
                c[i],
                got[i],
                a[i].mul_add(b[i], c[i])
            ))
            .unwrap_or_default()
    );
    if mode == burn_invariant_cubecl::FmaMode::Emulated {
        assert!(diff.is_empty(), "the fma emulation must round once");
    }
}

/// f32 FMA path vs the CPU `f32::mul_add` chain (the `Reference`), bit for bit, on every runtime:
/// the device `fma` where it rounds once, the emulation elsewhere.
fn fma_vs_cpu<R: Runtime>(client: &ComputeClient<R>) {
    let (m, k, n) = (67usize, 129usize, 255usize);
    let a = rand_vec(21, m * k, Dt::F32);
    let b = rand_vec(22, k * n, Dt::F32);
    let bias = rand_vec(23, n, Dt::F32);
    let (got, path) = gemm_run(client, (&a, &b, Some(&bias)), [m, k, n], Dt::F32);
    assert_eq!(path, GemmPath::Fma);
    let want = gemm_mul_add_chain(&a, &b, Some(&bias), m, k, n);
    let diff = got
        .iter()
        .zip(&want)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    eprintln!(
        "[{}] f32 FMA path vs CPU mul_add chain: {diff}/{} elements differ bitwise",
        runtime_name(client),
        got.len()
    );
    assert_eq!(
        diff, 0,
        "the f32 FMA path must reproduce the CPU mul_add chain bit for bit"
    );
}

fn row_reduction<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    // dRhs = lhsᵀ · dOut with lhs [M, K] row-major, passed as a [K, M] view with strides (1, K).
    let (m, k, n) = (67usize, 31usize, 33usize);
    let lhs = rand_vec(31, m * k, dt);
    let dout = rand_vec(32, m * n, dt);
    let run = |lhs: &[f32], dout: &[f32], m: usize| {
        let lb = upload(client, lhs, &[m, k], dt);
        let lt = view::<R>(&lb.handle, &[k, m], &[1, k]);
        let db = upload(client, dout, &[m, n], dt);
        let out = alloc_dense(client, &[k, n], dt);
        matmul_row_reduction(client, &lt, db.b(), out.b(), dt.storage()).expect("row reduction");
        read_2d(client, &out, dt, k, n)
    };
    let got = run(&lhs, &dout, m);
    // f64 reference: lhsᵀ as [K, M] row-major.
    let mut lt = vec![0.0f32; k * m];
    for i in 0..m {
        for j in 0..k {
            lt[j * m + i] = lhs[i * k + j];
        }
    }
    let (want, mag) = gemm_f64(&lt, &dout, None, k, m, n);
    assert_close(&format!("dRhs {dt:?}"), &got, &want, &mag, dt, m);
    assert_eq!(bits(&got), bits(&run(&lhs, &dout, m)), "dRhs rerun");
    // Append rows with zero dOut (and NaN/Inf/huge lhs rows): bitwise unchanged.
    for extra in [1usize, 16, 29, 64] {
        let mut lp = lhs.clone();
        let mut dp = dout.clone();
        for r in 0..extra {
            for c in 0..k {
                lp.push(match (r + c) % 4 {
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    2 => -3.0e4,
                    _ => 0.5,
                });
            }
            dp.extend(std::iter::repeat_n(0.0f32, n));
        }
        let gp = run(&lp, &dp, m + extra);
        assert_eq!(
            bits(&gp),
            bits(&got),
            "dRhs with {extra} zero-grad rows appended"
        );
    }
    eprintln!(
        "[{}] dRhs {dt:?}: vs f64 PASS, zero-grad padding rows bitwise invariant PASS",
        runtime_name(client)
    );
}

fn col_sum_check<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    for &(m, n) in &[(1usize, 1usize), (7, 33), (67, 255), (300, 5)] {
        let x = rand_vec((m * 7 + n) as u64, m * n, dt);
        let run = |x: &[f32], m: usize| {
            let xb = upload(client, x, &[m, n], dt);
            let out = alloc_dense(client, &[n], dt);
            col_sum(client, xb.b(), out.b(), dt.storage()).expect("col_sum");
            read_2d(client, &out, dt, n, 1)
        };
        let got = run(&x, m);
        let mut want = vec![0.0f64; n];
        let mut mag = vec![0.0f64; n];
        for i in 0..m {
            for j in 0..n {
                want[j] += x[i * n + j] as f64;
                mag[j] += (x[i * n + j] as f64).abs();
            }
        }
        assert_close(&format!("col_sum {dt:?} {m}x{n}"), &got, &want, &mag, dt, m);
        let mut xp = x.clone();
        xp.extend(std::iter::repeat_n(0.0f32, 3 * n));
        xp.extend(std::iter::repeat_n(-0.0f32, 2 * n));
        assert_eq!(
            bits(&run(&xp, m + 5)),
            bits(&got),
            "col_sum zero rows appended"
        );
    }
    eprintln!(
        "[{}] col_sum {dt:?}: vs f64 + zero-row invariance PASS",
        runtime_name(client)
    );
}

fn errors<R: Runtime>(client: &ComputeClient<R>) {
    let dt = Dt::F32;
    let a = upload(client, &rand_vec(1, 6, dt), &[2, 3], dt);
    let b = upload(client, &rand_vec(2, 12, dt), &[4, 3], dt);
    let out = alloc_dense(client, &[2, 3], dt);
    let e = matmul(client, a.b(), b.b(), None, out.b(), dt.storage()).unwrap_err();
    assert!(matches!(e, KernelError::Shape { arg: "rhs", .. }), "{e}");
    eprintln!("error (inner dims): {e}");

    let b = upload(client, &rand_vec(2, 12, dt), &[3, 4], dt);
    let e = matmul(client, a.b(), b.b(), None, out.b(), dt.storage()).unwrap_err();
    assert!(matches!(e, KernelError::Shape { arg: "out", .. }), "{e}");

    let bias = upload(client, &rand_vec(3, 3, dt), &[3], dt);
    let out = alloc_dense(client, &[2, 4], dt);
    let e = matmul(client, a.b(), b.b(), Some(bias.b()), out.b(), dt.storage()).unwrap_err();
    assert!(matches!(e, KernelError::Shape { arg: "bias", .. }), "{e}");

    let r3 = view::<R>(&a.handle, &[1, 2, 3], &[6, 3, 1]);
    let e = matmul(client, &r3, b.b(), None, out.b(), dt.storage()).unwrap_err();
    assert!(matches!(e, KernelError::Rank { arg: "lhs", .. }), "{e}");

    // A view that addresses past the end of its buffer.
    let big = view::<R>(&a.handle, &[2, 30], &[30, 1]);
    let e = matmul(client, &big, b.b(), None, out.b(), dt.storage()).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::Layout { arg: "lhs", .. } | KernelError::Shape { .. }
        ),
        "{e}"
    );
    let big = view::<R>(&b.handle, &[3, 4], &[100, 1]);
    let e = matmul(client, a.b(), &big, None, out.b(), dt.storage()).unwrap_err();
    assert!(matches!(e, KernelError::Layout { arg: "rhs", .. }), "{e}");
    eprintln!("error (out of bounds view): {e}");

    // Unsupported dtype.
    let e = matmul(client, a.b(), b.b(), None, out.b(), i32_storage()).unwrap_err();
    assert!(matches!(e, KernelError::UnsupportedDtype { .. }), "{e}");

    // Overflowing strides.
    let huge = view::<R>(&a.handle, &[2, 3], &[1usize << 31, 1]);
    let e = matmul(client, &huge, b.b(), None, out.b(), dt.storage()).unwrap_err();
    assert!(matches!(e, KernelError::IndexOverflow { .. }), "{e}");
    eprintln!("error (32-bit overflow): {e}");

    // bf16 where the runtime has no bf16 (wgpu/WGSL).
    if !burn_invariant_cubecl::runtime_supports(client, Dt::BF16.storage()) {
        let e = matmul(client, a.b(), b.b(), None, out.b(), Dt::BF16.storage()).unwrap_err();
        assert!(
            matches!(e, KernelError::DtypeNotSupportedByRuntime { .. }),
            "{e}"
        );
        eprintln!("error (bf16): {e}");
        let e = matmul_path(client, Dt::BF16.storage(), 3, 4).unwrap_err();
        assert!(
            matches!(e, KernelError::DtypeNotSupportedByRuntime { .. }),
            "{e}"
        );
    }
    // Empty shapes are fine.
    let z = alloc_dense(client, &[0, 4], dt);
    let a0 = view::<R>(&a.handle, &[0, 3], &[3, 1]);
    matmul(client, &a0, b.b(), None, z.b(), dt.storage()).expect("M = 0");
    // K = 0: out = bias.
    let a0k = view::<R>(&a.handle, &[2, 0], &[1, 1]);
    let b0k = view::<R>(&b.handle, &[0, 4], &[4, 1]);
    let bias4 = upload(client, &[1.0, 2.0, 3.0, 4.0], &[4], dt);
    let out = alloc_dense(client, &[2, 4], dt);
    matmul(client, &a0k, &b0k, Some(bias4.b()), out.b(), dt.storage()).expect("K = 0");
    assert_eq!(
        read_2d(client, &out, dt, 2, 4),
        vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]
    );
    eprintln!("[{}] gemm error cases: PASS", runtime_name(client));
}

fn paths<R: Runtime>(client: &ComputeClient<R>) {
    let p32 = matmul_path(client, Dt::F32.storage(), 4096, 4096).unwrap();
    assert_eq!(p32, GemmPath::Fma);
    let p16 = matmul_path(client, Dt::F16.storage(), 4096, 4096).unwrap();
    eprintln!(
        "[{}] path f32: {p32}; path f16: {p16}; bf16 supported: {}",
        runtime_name(client),
        burn_invariant_cubecl::runtime_supports(client, Dt::BF16.storage())
    );
}

fn suite<R: Runtime>(client: &ComputeClient<R>, dts: &[Dt]) {
    paths(client);
    fma_emulation(client);
    fma_vs_cpu(client);
    for &dt in dts {
        correctness(client, dt);
        row_invariance(client, dt);
        strided_layouts(client, dt);
        layouts_and_load_widths(client, dt);
        ring_depths(client, dt);
        row_reduction(client, dt);
        col_sum_check(client, dt);
    }
    errors(client);
}

#[test]
fn gemm_wgpu() {
    with_wgpu("gemm_wgpu", |client| suite(client, &[Dt::F32, Dt::F16]));
}

#[cfg(feature = "cuda")]
#[test]
fn gemm_cuda() {
    with_cuda(|client| suite(client, &[Dt::F32, Dt::F16, Dt::BF16]));
}
