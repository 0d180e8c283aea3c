//! Rough timings (CUDA only, `#[ignore]`): `cargo test -p burn-invariant-cubecl --features cuda
//! --test perf -- --ignored --nocapture`.

#[cfg(feature = "cuda")]
mod common;

#[cfg(feature = "cuda")]
#[test]
#[ignore]
fn perf_cuda() {
    use burn_invariant_cubecl::{
        LinearLogpInputs, linear_logp_forward, linear_logp_forward_workspace_len, matmul,
    };
    use common::*;
    use std::time::Instant;

    with_cuda(|client| {
        let sync = || cubecl::future::block_on(client.sync()).unwrap();
        for &dt in &[Dt::F32, Dt::BF16, Dt::F16] {
            for &(m, k, n) in &[(4096usize, 4096usize, 4096usize), (64, 4096, 4096)] {
                let a = upload(client, &rand_vec(1, m * k, dt), &[m, k], dt);
                let b = upload(client, &rand_vec(2, k * n, dt), &[k, n], dt);
                let out = alloc_dense(client, &[m, n], dt);
                let path = matmul(client, a.b(), b.b(), None, out.b(), dt.storage()).unwrap();
                sync();
                let reps = if m >= 1024 { 5 } else { 20 };
                let t = Instant::now();
                for _ in 0..reps {
                    matmul(client, a.b(), b.b(), None, out.b(), dt.storage()).unwrap();
                }
                sync();
                let s = t.elapsed().as_secs_f64() / reps as f64;
                eprintln!(
                    "matmul {dt:?} M={m} K={k} N={n}: {:.3} ms, {:.1} TFLOP/s ({path})",
                    s * 1e3,
                    2.0 * (m * k * n) as f64 / s / 1e12
                );
            }
        }
        for &dt in &[Dt::F32, Dt::BF16] {
            let (nn, d, v) = (4096usize, 2048usize, 32768usize);
            let h = upload(client, &rand_vec(3, nn * d, dt), &[nn, d], dt);
            let w = upload(client, &rand_vec(4, v * d, dt), &[v, d], dt);
            let t: Vec<i32> = (0..nn as i32).map(|i| (i * 7919) % v as i32).collect();
            let tb = upload_i32(client, &t);
            let stats = alloc_dense(client, &[nn, 2], Dt::F32);
            let ws = alloc_dense(client, &[linear_logp_forward_workspace_len(nn, v)], Dt::F32);
            let inp = LinearLogpInputs {
                hidden: h.b(),
                weight: w.b(),
                bias: None,
                targets: tb.b(),
                targets_dtype: i32_storage(),
                ignore_index: None,
                dtype: dt.storage(),
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
