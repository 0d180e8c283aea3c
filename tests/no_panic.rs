#![allow(unused_macros)] // the shared test module's suite macro is not used here
//! Random valid and invalid calls of the public API (`matmul`, `linear`, `linear_logp_full`,
//! `attention`, `rms_norm` and their backward) must return `Ok` or an `Err`, never panic: shapes with zeros, targets of every
//! integer dtype the backend holds, NaN/Inf inputs, targets out of range, mismatched dtypes and
//! shapes, `ignore_index` and `skip_target_check` on and off, valid and invalid temperatures,
//! entropy on and off. 500 calls per backend (NdArray,
//! wgpu raw and under Fusion), each
//! under `catch_unwind`; the inputs are built outside it (a panic of Burn's own constructors is
//! not a panic of this crate).
mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::tensor::{DType, IntDType, backend::AutodiffBackend};
use burn_invariant::{InvariantBackend, LinearLogpOptions};
use common::{Rng, float, ints};

const CALLS: usize = 500;

/// A size for a dimension: often 0 or 1, otherwise small and off any tile.
fn size(rng: &mut Rng) -> usize {
    match rng.below(6) {
        0 => 0,
        1 => 1,
        _ => 1 + rng.below(70),
    }
}

/// Values with an occasional NaN or ±Inf.
fn values(rng: &mut Rng, len: usize) -> Vec<f32> {
    let special = rng.below(4) == 0;
    (0..len)
        .map(|_| match (special, rng.below(40)) {
            (true, 0) => f32::NAN,
            (true, 1) => f32::INFINITY,
            (true, 2) => f32::NEG_INFINITY,
            _ => rng.uniform(),
        })
        .collect()
}

/// The backward of `t.sum()` where `t` has elements (Burn's own `sum` and its backward panic on
/// an empty tensor on wgpu: not this crate's call, so not driven here).
fn backward_if_any<B: AutodiffBackend, const D: usize>(t: burn::tensor::Tensor<B, D>) {
    if t.shape().num_elements() > 0 {
        let _ = t.sum().backward();
    } else {
        let _ = t.into_data();
    }
}

/// Drives `CALLS` random calls on `B`; returns the panics as `(call, description)`.
fn drive<B: AutodiffBackend + InvariantBackend>(
    device: &B::Device,
    floats: &[DType],
    int_dtypes: &[IntDType],
    seed: u64,
) -> (Vec<(usize, String)>, [usize; 2]) {
    let mut rng = Rng::new(seed);
    let mut panics = Vec::new();
    let mut outcomes = [0usize; 2]; // [ok, err]
    for call in 0..CALLS {
        let pick = |rng: &mut Rng, xs: &[DType]| xs[rng.below(xs.len())];
        let dtype = pick(&mut rng, floats);
        // Now and then one operand of another dtype, or a shape that does not fit.
        let other = if rng.below(8) == 0 {
            pick(&mut rng, floats)
        } else {
            dtype
        };
        let misfit = usize::from(rng.below(10) == 0);
        let (n, d, v) = (size(&mut rng), size(&mut rng), size(&mut rng));
        let hidden = float::<B, 2>(values(&mut rng, n * d), [n, d], device, dtype).require_grad();
        let weight = float::<B, 2>(
            values(&mut rng, v * (d + misfit)),
            [v, d + misfit],
            device,
            other,
        )
        .require_grad();
        let bias = (rng.below(2) == 0)
            .then(|| float::<B, 1>(values(&mut rng, v), [v], device, dtype).require_grad());
        let what = format!("call {call}: {dtype:?}/{other:?} n={n} d={d} v={v} misfit={misfit}");
        let result = match rng.below(5) {
            3 => attention_call::<B>(&mut rng, device, dtype, other, misfit),
            4 => {
                let gamma =
                    float::<B, 1>(values(&mut rng, d + misfit), [d + misfit], device, other)
                        .require_grad();
                let eps = [1e-5, 0.0, -1.0, f64::NAN][rng.below(4)];
                catch_unwind(AssertUnwindSafe(|| {
                    burn_invariant::rms_norm(hidden.clone(), gamma, eps).map(backward_if_any)
                }))
            }
            0 => {
                let rhs = weight.clone().transpose();
                catch_unwind(AssertUnwindSafe(|| {
                    burn_invariant::matmul(hidden.clone(), rhs).map(backward_if_any)
                }))
            }
            1 => catch_unwind(AssertUnwindSafe(|| {
                burn_invariant::linear(hidden.clone(), weight.clone(), bias.clone())
                    .map(backward_if_any)
            })),
            _ => {
                let int_dtype = int_dtypes[rng.below(int_dtypes.len())];
                let unsigned = matches!(
                    int_dtype,
                    IntDType::U8 | IntDType::U16 | IntDType::U32 | IntDType::U64
                );
                let targets: Vec<i64> = (0..n)
                    .map(|_| match rng.below(12) {
                        0 if !unsigned => -100,
                        1 => v as i64 + rng.below(3) as i64,
                        2 if !unsigned => -1 - rng.below(3) as i64,
                        _ => rng.below(v.max(1)) as i64,
                    })
                    .collect();
                let targets = ints::<B>(targets, device).cast(int_dtype);
                let mut options = LinearLogpOptions::default();
                if rng.below(2) == 0 {
                    options = options.with_ignore_index(-100);
                }
                options = options.with_skip_target_check(rng.below(3) == 0);
                // The RL head: temperatures valid and not, entropy on and off.
                let temperatures = [1.0, 0.7, 1.7, 0.0, -1.0, f64::NAN, f64::INFINITY, 1e-300];
                options = options
                    .with_temperature(temperatures[rng.below(temperatures.len())])
                    .with_entropy(rng.below(2) == 0);
                let backward = rng.below(2) == 0;
                catch_unwind(AssertUnwindSafe(|| {
                    burn_invariant::linear_logp_full(
                        hidden.clone(),
                        weight.clone(),
                        targets,
                        bias.clone(),
                        &options,
                    )
                    .map(|out| {
                        if backward {
                            let mut loss = out.logp * 0.5 + out.lse;
                            if let Some(entropy) = out.entropy {
                                loss = loss + entropy * 0.25;
                            }
                            backward_if_any(loss);
                        } else {
                            let _ = out.logp.into_data();
                        }
                    })
                }))
            }
        };
        match result {
            Ok(Ok(())) => outcomes[0] += 1,
            Ok(Err(_)) => outcomes[1] += 1,
            Err(_) => panics.push((call, what)),
        }
    }
    (panics, outcomes)
}

/// One random `attention` call (and its backward): GQA head counts that divide or not,
/// `kv_lens` in and out of range or of the wrong length, causal or not, odd scales.
fn attention_call<B: AutodiffBackend + InvariantBackend>(
    rng: &mut Rng,
    device: &B::Device,
    dtype: DType,
    other: DType,
    misfit: usize,
) -> std::thread::Result<Result<(), burn_invariant::InvariantError>> {
    let (batch, kv_heads) = (rng.below(3), 1 + rng.below(2));
    let heads = kv_heads * (1 + rng.below(3)) + misfit;
    let (q_len, kv_len, head_dim) = (rng.below(9), rng.below(80), rng.below(20));
    let q_shape = [batch, heads, q_len, head_dim];
    let kv_shape = [batch, kv_heads, kv_len, head_dim];
    let query = float::<B, 4>(
        values(rng, q_shape.iter().product()),
        q_shape,
        device,
        dtype,
    )
    .require_grad();
    let key = float::<B, 4>(
        values(rng, kv_shape.iter().product()),
        kv_shape,
        device,
        other,
    )
    .require_grad();
    let value = float::<B, 4>(
        values(rng, kv_shape.iter().product()),
        kv_shape,
        device,
        dtype,
    )
    .require_grad();
    let kv_lens = (rng.below(2) == 0).then(|| {
        let rows = batch + usize::from(rng.below(10) == 0);
        let lens = (0..rows)
            .map(|_| rng.below(kv_len + 2) as i64 - i64::from(rng.below(10) == 0))
            .collect();
        ints::<B>(lens, device)
    });
    let mut options = burn_invariant::AttentionOptions::default().with_causal(rng.below(2) == 0);
    if rng.below(4) == 0 {
        options = options.with_scale([0.5, f64::NAN, f64::INFINITY, 1e300][rng.below(4)]);
    }
    catch_unwind(AssertUnwindSafe(|| {
        burn_invariant::attention(query, key, value, kv_lens, &options).map(backward_if_any)
    }))
}

fn check<B: AutodiffBackend + InvariantBackend>(
    name: &str,
    device: &B::Device,
    floats: &[DType],
    int_dtypes: &[IntDType],
) {
    let hook = std::panic::take_hook();
    if std::env::var_os("NO_PANIC_VERBOSE").is_none() {
        std::panic::set_hook(Box::new(|_| {}));
    }
    let (panics, [ok, err]) = drive::<B>(device, floats, int_dtypes, 2026);
    std::panic::set_hook(hook);
    eprintln!(
        "{name}: {CALLS} calls, {ok} Ok, {err} Err, {} panics",
        panics.len()
    );
    assert!(
        panics.is_empty(),
        "{name}: calls that panicked: {panics:#?}"
    );
    // Both outcomes occur, so the generator reaches valid and invalid calls alike.
    assert!(
        ok > CALLS / 10 && err > CALLS / 20,
        "{name}: {ok} Ok, {err} Err"
    );
}

#[test]
fn ndarray_public_calls_never_panic() {
    type B = burn::backend::Autodiff<burn_ndarray::NdArray<f32>>;
    let ints = [
        IntDType::I64,
        IntDType::I32,
        IntDType::I16,
        IntDType::I8,
        IntDType::U64,
        IntDType::U32,
        IntDType::U16,
        IntDType::U8,
    ];
    check::<B>(
        "ndarray",
        &Default::default(),
        &[DType::F32, DType::F64],
        &ints,
    );
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_public_calls_never_panic() {
    use burn_wgpu::WgpuRuntime;
    type B = burn::backend::Autodiff<burn_cubecl::CubeBackend<WgpuRuntime, f32, i32, u32>>;
    let Some(device) = common::wgpu_device() else {
        return;
    };
    type Fused = burn::backend::Autodiff<
        burn_fusion::Fusion<burn_cubecl::CubeBackend<WgpuRuntime, f32, i32, u32>>,
    >;
    // WGSL: no bf16, no 8-/16-bit or unsigned 64-bit integers.
    let (floats, ints) = ([DType::F32, DType::F16], [IntDType::I32, IntDType::U32]);
    check::<B>("wgpu", &device, &floats, &ints);
    check::<Fused>("wgpu fusion", &device, &floats, &ints);
}
