//! Rough timings (CUDA only, `#[ignore]`): `cargo test -p burn-invariant-cubecl --features cuda
//! --test perf -- --ignored --nocapture`.

#[cfg(feature = "cuda")]
mod common;

/// The `[K, N]` rhs row-major, or as the transposed view of an `[N, K]` weight.
#[cfg(feature = "cuda")]
fn upload_rhs(
    client: &cubecl::prelude::ComputeClient<cubecl::cuda::CudaRuntime>,
    data: &[f32],
    k: usize,
    n: usize,
    dt: common::Dt,
    transposed: bool,
) -> common::Buf<cubecl::cuda::CudaRuntime> {
    if transposed {
        common::upload_transposed_view(client, data, k, n, dt)
    } else {
        common::upload(client, data, &[k, n], dt)
    }
}

/// Median over five samples of the mean time of `reps` calls, each sample ended by a device sync.
#[cfg(feature = "cuda")]
fn median_seconds(reps: usize, sync: &dyn Fn(), mut call: impl FnMut()) -> f64 {
    let mut samples: Vec<f64> = (0..5)
        .map(|_| {
            let t = std::time::Instant::now();
            for _ in 0..reps {
                call();
            }
            sync();
            t.elapsed().as_secs_f64() / reps as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[2]
}

#[cfg(feature = "cuda")]
#[test]
#[ignore]
fn perf_cuda() {
    use burn_invariant_cubecl::gemm::{CmmaTile, matmul_cmma_tiled};
    use burn_invariant_cubecl::{
        LogpInputRefs, linear_logp_forward, linear_logp_forward_workspace_len, matmul,
    };
    use common::*;
    use std::time::Instant;

    with_cuda(|client| {
        let sync = || cubecl::future::block_on(client.sync()).unwrap();
        // The five projection shapes of the GPU report (M = 4096) plus a decode row block; the rhs both
        // row-major `[K, N]` and as the transposed view of a `[N, K]` weight (what `linear` sees).
        let shapes = [
            (4096usize, 4096usize, 4096usize),
            (4096, 4096, 12288),
            (4096, 4096, 14336),
            (4096, 14336, 4096),
            (4096, 4096, 32000),
            (64, 4096, 4096),
        ];
        for &dt in &[Dt::BF16, Dt::F16, Dt::F32] {
            for &(m, k, n) in &shapes {
                if dt == Dt::F32 && m == 4096 && (k, n) != (4096, 4096) {
                    continue;
                }
                let a = upload(client, &rand_vec(1, m * k, dt), &[m, k], dt);
                let b_rows = rand_vec(2, k * n, dt);
                for transposed in [false, true] {
                    let b = upload_rhs(client, &b_rows, k, n, dt, transposed);
                    let out = alloc_dense(client, &[m, n], dt);
                    let run = || matmul(client, a.b(), b.b(), None, out.b(), dt.storage()).unwrap();
                    let path = run();
                    // A kernel that failed to build leaves the output at its fill (-7.25):
                    // never time that.
                    let first = read_raw(client, &out, dt);
                    assert!(
                        first.iter().any(|v| *v != -7.25),
                        "matmul {dt:?} {m}x{k}x{n} wrote nothing"
                    );
                    let s = median_seconds(if m >= 1024 { 10 } else { 50 }, &sync, || {
                        run();
                    });
                    eprintln!(
                        "PERF matmul {dt:?} M={m} K={k} N={n} rhs_t={transposed}: {:.3} ms, \
                         {:.1} TFLOP/s ({path})",
                        s * 1e3,
                        2.0 * (m * k * n) as f64 / s / 1e12
                    );
                }
            }
        }
        // Candidate cmma tilings (tuning only: every tiling must give the pinned tiling's bits).
        let tiles = [
            (128usize, 128usize, 64usize, 2usize, 2usize, 3usize, 1usize),
            (128, 128, 64, 2, 2, 3, 2),
            (128, 128, 64, 2, 2, 4, 2),
            (128, 128, 32, 2, 2, 5, 2),
            (128, 128, 32, 2, 4, 5, 2),
            (128, 256, 64, 2, 4, 3, 1),
            (128, 256, 64, 2, 4, 4, 2),
            (128, 256, 32, 2, 4, 6, 2),
            (256, 128, 32, 4, 2, 6, 2),
            (256, 128, 64, 4, 2, 4, 2),
        ];
        for &dt in &[Dt::BF16] {
            for &(m, k, n) in &[shapes[0], shapes[3], shapes[4]] {
                let a = upload(client, &rand_vec(1, m * k, dt), &[m, k], dt);
                let b_rows = rand_vec(2, k * n, dt);
                for transposed in [false, true] {
                    let b = upload_rhs(client, &b_rows, k, n, dt, transposed);
                    let pinned = alloc_dense(client, &[m, n], dt);
                    matmul(client, a.b(), b.b(), None, pinned.b(), dt.storage()).unwrap();
                    let want = read_raw(client, &pinned, dt);
                    for (&(bm, bn, bk, pm, pn, stages, lag), manual) in
                        tiles.iter().map(|t| (t, true))
                    {
                        let tile = CmmaTile {
                            bm,
                            bn,
                            bk,
                            pm,
                            pn,
                            stages,
                            lag,
                        };
                        let out = alloc_dense(client, &[m, n], dt);
                        let run = || {
                            let (a, b, o) = (a.b(), b.b(), out.b());
                            matmul_cmma_tiled(client, a, b, o, dt.storage(), tile, manual)
                        };
                        if let Err(e) = run() {
                            eprintln!("TILE {tile:?}: {e}");
                            continue;
                        }
                        let same = read_raw(client, &out, dt)
                            .iter()
                            .zip(&want)
                            .all(|(x, y)| x.to_bits() == y.to_bits());
                        assert!(same, "tiling {tile:?} changed the bits");
                        let s = median_seconds(10, &sync, || run().unwrap());
                        eprintln!(
                            "TILE {dt:?} M={m} K={k} N={n} rhs_t={transposed} {bm}x{bn}x{bk} \
                             planes {pm}x{pn} stages={stages} lag={lag} manual={manual}: {:.3} ms, {:.1} TFLOP/s (bits = pinned)",
                            s * 1e3,
                            2.0 * (m * k * n) as f64 / s / 1e12
                        );
                    }
                }
            }
        }
        for &dt in &[Dt::F32, Dt::BF16] {
            let (nn, d, v) = (4096usize, 2048usize, 32768usize);
            let h = upload(client, &rand_vec(3, nn * d, dt), &[nn, d], dt);
            let w = upload(client, &rand_vec(4, v * d, dt), &[v, d], dt);
            let t: Vec<i32> = (0..nn as i32).map(|i| (i * 7919) % v as i32).collect();
            let tb = upload_i32(client, &t);
            let stats = alloc_dense(client, &[nn, 2], Dt::F32);
            let ws = alloc_dense(
                client,
                &[linear_logp_forward_workspace_len(nn, v, dt.storage())],
                Dt::F32,
            );
            let inp = LogpInputRefs {
                hidden: h.b(),
                weight: w.b(),
                bias: None,
                targets: tb.b(),
                targets_dtype: i32_storage(),
                ignore_index: None,
                dtype: dt.storage(),
                inv_temperature: 1.0,
                entropy: false,
            };
            linear_logp_forward(client, &inp, stats.b(), ws.b()).unwrap();
            sync();
            let reps = 3;
            let t0 = Instant::now();
            for _ in 0..reps {
                linear_logp_forward(client, &inp, stats.b(), ws.b()).unwrap();
            }
            sync();
            let s = t0.elapsed().as_secs_f64() / reps as f64;
            eprintln!(
                "linear_logp forward {dt:?} N={nn} D={d} V={v}: {:.3} ms, {:.1} TFLOP/s",
                s * 1e3,
                2.0 * (nn * d * v) as f64 / s / 1e12
            );
        }
    });
}
