//! The generic suite on the CubeCL backends: wgpu (lavapipe in CI) and CUDA (an H100 on the
//! device machine), each raw and under Fusion. Without a device a test prints a notice and
//! passes, unless `BURN_INVARIANT_REQUIRE_WGPU=1` / `BURN_INVARIANT_REQUIRE_CUDA=1` makes the
//! missing device a failure (CI sets the first, the GPU run the second).
#![cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]

#[macro_use]
mod common;

/// Cross-backend reference mode: the f32 `CubeCl` GEMM (FMA path) gives the bits of `Reference`
/// (NdArray, `f32::mul_add` chains), with and without bias, on shapes that are no multiple of any
/// tile. On lavapipe this runs the emulated once-rounded `fma` (its `fma` rounds twice).
fn f32_matmul_equals_reference<B: burn_invariant::InvariantBackend>(device: &B::Device) {
    use burn_invariant::ops::matmul::MatmulOps;
    type Reference = burn_ndarray::NdArray<f32>;
    let cpu = Default::default();
    let dtype = burn::tensor::DType::F32;
    for (i, shape) in [[1, 1, 1], [67, 129, 255], [33, 65, 17], [130, 136, 70]]
        .into_iter()
        .enumerate()
    {
        let (with_bias, seed) = (i % 2 == 1, 300 + i as u64);
        let got = common::bits(common::matmul(&common::gemm_problem::<B>(
            device, dtype, shape, with_bias, seed,
        )));
        // The oracle named explicitly, whatever `BURN_INVARIANT_IMPL` forces for the device.
        let p = common::gemm_problem::<Reference>(&cpu, dtype, shape, with_bias, seed);
        let prim = |t: burn::tensor::Tensor<Reference, 2>| t.into_primitive().tensor();
        let want = common::bits(burn::tensor::Tensor::<Reference, 2>::from_primitive(
            burn::tensor::TensorPrimitive::Float(<Reference as MatmulOps>::invariant_matmul(
                prim(p.lhs.clone()),
                prim(p.rhs.clone()),
                p.bias.clone().map(|b| b.into_primitive().tensor()),
                burn_invariant::registry::Implementation::Reference,
            )),
        ));
        common::assert_bits_eq(&format!("f32 matmul {shape:?} vs Reference"), &got, &want);
    }
}

/// Cross-backend reference mode for the sampler: the f32 `CubeCl` kernels draw the Reference's
/// tokens (the same logits, the same noise bits, the same candidate order) for every option set;
/// the Reference's from its oracle (whatever `BURN_INVARIANT_IMPL` forces).
fn f32_sample_tokens_equal_reference<B: burn_invariant::InvariantBackend>(device: &B::Device) {
    use burn_invariant::ops::linear_sample::{SampleRule, Sampler, oracle};
    let dtype = burn::tensor::DType::F32;
    let [n, d, v] = [7, 29, 8229];
    let p = common::logp_problem::<B>(device, dtype, [n, d, v], true, None, 77);
    let host = |t: Vec<f64>| -> Vec<f32> { t.into_iter().map(|x| x as f32).collect() };
    let h = host(common::values(p.hidden.clone()));
    let w = host(common::values(p.weight.clone()));
    let b = host(common::values(p.bias.clone().expect("bias")));
    for options in common::sampler::option_sets() {
        let got = common::sampler::sample(&p, p.hidden.clone(), p.targets.clone(), &options);
        let got: Vec<i64> = got.tokens.into_data().iter::<i64>().collect();
        let rule = match (options.greedy, options.top_k) {
            (true, _) => SampleRule::Greedy,
            (false, Some(k)) => SampleRule::TopK(k),
            (false, None) => SampleRule::Gumbel,
        };
        let problem = burn_invariant::oracle::LogpProblem {
            hidden: &h,
            weight: &w,
            bias: Some(&b),
            targets: &p.target_values,
            ignore_index: None,
            n,
            d,
            v,
            inv_temperature: (1.0 / options.temperature) as f32,
            entropy: false,
        };
        let sampler = Sampler {
            seed: options.seed,
            rule,
        };
        let want: Vec<i64> = oracle::linear_sample(&problem, &sampler)
            .chunks(3)
            .map(|row| row[2] as i64)
            .collect();
        assert_eq!(got, want, "f32 tokens vs Reference {options:?}");
    }
}

/// Cross-backend reference mode for attention and RMSNorm: f32 `CubeCl` (forward and backward
/// primitives) gives the bits of `Reference`, on shapes that are multiples of no tile, with
/// GQA, ragged `kv_lens` (one row empty) and zero-gradient rows.
fn f32_attention_and_rms_norm_equal_reference<B: burn_invariant::InvariantBackend>(
    device: &B::Device,
) {
    use burn::tensor::{Tensor, TensorPrimitive};
    use burn_invariant::ops::attention::{AttentionInputs, AttentionOutput};
    use burn_invariant::ops::rms_norm::RmsNormInputs;
    use burn_invariant::registry::Implementation;
    type Reference = burn_ndarray::NdArray<f32>;
    let cpu = Default::default();
    let d = common::ops::Dims {
        batch: 3,
        heads: 6,
        kv_heads: 2,
        q_len: 9,
        kv_len: 133,
        head_dim: 36,
    };
    let kv_lens = vec![133i64, 70, 0];
    let mut rng = common::Rng::new(91);
    let up_data = rng.vec(d.batch * d.heads * d.q_len * d.head_dim, 1.0);
    let up_data: Vec<f32> = up_data
        .iter()
        .enumerate()
        .map(|(i, &x)| if (i / d.head_dim) % 4 == 1 { 0.0 } else { x })
        .collect();
    fn run<X: burn_invariant::InvariantBackend>(
        device: &X::Device,
        d: common::ops::Dims,
        kv_lens: &[i64],
        up: &[f32],
        imp: Implementation,
    ) -> Vec<Vec<u64>> {
        let dtype = burn::tensor::DType::F32;
        let prim = |t: Tensor<X, 4>| t.into_primitive().tensor();
        let back = |t| common::bits(Tensor::<X, 4>::from_primitive(TensorPrimitive::Float(t)));
        let [q, k, v] = common::ops::qkv::<X>(device, dtype, d, 92);
        let inputs = AttentionInputs {
            query: prim(q),
            key: prim(k),
            value: prim(v),
            kv_lens: common::ints::<X>(kv_lens.to_vec(), device).into_primitive(),
            causal: true,
            scale: 0.17,
        };
        let out = X::invariant_attention(inputs.clone(), imp);
        let up = common::float::<X, 4>(
            up.to_vec(),
            [d.batch, d.heads, d.q_len, d.head_dim],
            device,
            dtype,
        );
        let saved = AttentionOutput {
            out: out.out.clone(),
            lse: out.lse.clone(),
        };
        let grads = X::invariant_attention_backward(inputs, saved, prim(up), imp);
        let mut rng = common::Rng::new(93);
        let (n, dm) = (37, 300);
        let x = common::float::<X, 2>(rng.vec(n * dm, 2.0), [n, dm], device, dtype);
        let gamma = common::float::<X, 1>(rng.vec(dm, 1.0), [dm], device, dtype);
        let dy = common::float::<X, 2>(rng.vec(n * dm, 1.0), [n, dm], device, dtype);
        let norm = RmsNormInputs {
            x: x.into_primitive().tensor(),
            gamma: gamma.into_primitive().tensor(),
            eps: 1e-6,
        };
        let y = X::invariant_rms_norm(norm.clone(), imp);
        let ng = X::invariant_rms_norm_backward(norm, dy.into_primitive().tensor(), imp);
        let bits2 = |t| common::bits(Tensor::<X, 2>::from_primitive(TensorPrimitive::Float(t)));
        let bits1 = |t| common::bits(Tensor::<X, 1>::from_primitive(TensorPrimitive::Float(t)));
        vec![
            back(out.out),
            common::bits(Tensor::<X, 3>::from_primitive(TensorPrimitive::Float(
                out.lse,
            ))),
            back(grads.query),
            back(grads.key),
            back(grads.value),
            bits2(y),
            bits2(ng.x),
            bits1(ng.gamma),
        ]
    }
    let got = run::<B>(device, d, &kv_lens, &up_data, Implementation::CubeCl);
    let want = run::<Reference>(&cpu, d, &kv_lens, &up_data, Implementation::Reference);
    let names = [
        "out",
        "lse",
        "dQuery",
        "dKey",
        "dValue",
        "rms y",
        "rms dX",
        "rms dGamma",
    ];
    for ((name, g), w) in names.iter().zip(&got).zip(&want) {
        common::assert_bits_eq(&format!("f32 {name} vs Reference"), g, w);
    }
}

#[cfg(feature = "wgpu")]
mod wgpu {
    pub use super::common::wgpu_device as device;

    mod raw {
        use super::super::common;
        type B = burn_cubecl::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u32>;
        type AD = burn::backend::Autodiff<B>;
        invariant_testsuite!(B, AD, super::device(), dtypes: [burn::tensor::DType::F32, burn::tensor::DType::F16], other_dtype: burn::tensor::DType::F16);

        #[test]
        #[serial]
        fn f32_matmul_bitwise_equals_reference() {
            let Some(device) = device() else { return };
            super::super::f32_matmul_equals_reference::<B>(&device);
        }

        #[test]
        #[serial]
        fn f32_attention_and_rms_norm_bitwise_equal_reference() {
            let Some(device) = device() else { return };
            super::super::f32_attention_and_rms_norm_equal_reference::<B>(&device);
        }

        #[test]
        #[serial]
        fn f32_sample_tokens_equal_reference() {
            let Some(device) = device() else { return };
            super::super::f32_sample_tokens_equal_reference::<B>(&device);
        }

        /// The tensor-core path's chunk loops, scan and `dz` kernels (with FMA products, as
        /// lavapipe has no cooperative matrices) under the RL head: temperature and entropy.
        #[test]
        #[serial]
        fn rl_head_on_the_tensor_core_path() {
            let Some(device) = device() else { return };
            let dtype = burn::tensor::DType::F16;
            burn_invariant_cubecl::with_chunked_fma(|| {
                common::rl_head::head_correctness::<B>(&device, dtype);
                common::rl_head::head_row_invariance::<B>(&device, dtype);
                common::rl_head::head_gradients_f64::<AD>(&device, dtype, [7, 13, 97]);
                common::rl_head::head_backward_invariance::<AD>(&device, dtype);
                common::sampler::sample_scores_are_linear_logp_full::<B>(&device, dtype);
                common::sampler::sample_row_invariance::<B>(&device, dtype);
                common::sampler::sample_greedy_is_argmax::<B>(&device, dtype);
            });
        }
    }

    mod fusion {
        use super::super::common;
        type B =
            burn_fusion::Fusion<burn_cubecl::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u32>>;
        type AD = burn::backend::Autodiff<B>;
        invariant_testsuite!(B, AD, super::device(), dtypes: [burn::tensor::DType::F32, burn::tensor::DType::F16], other_dtype: burn::tensor::DType::F16);

        #[test]
        #[serial]
        fn f32_matmul_bitwise_equals_reference() {
            let Some(device) = device() else { return };
            super::super::f32_matmul_equals_reference::<B>(&device);
        }

        #[test]
        #[serial]
        fn f32_attention_and_rms_norm_bitwise_equal_reference() {
            let Some(device) = device() else { return };
            super::super::f32_attention_and_rms_norm_equal_reference::<B>(&device);
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    pub use super::common::cuda_device as device;

    mod raw {
        use super::super::common;
        type B = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
        type AD = burn::backend::Autodiff<B>;
        invariant_testsuite!(B, AD, super::device(), dtypes: [burn::tensor::DType::F32, burn::tensor::DType::F16, burn::tensor::DType::BF16], other_dtype: burn::tensor::DType::BF16);

        #[test]
        #[serial]
        fn f32_matmul_bitwise_equals_reference() {
            let Some(device) = device() else { return };
            super::super::f32_matmul_equals_reference::<B>(&device);
        }

        #[test]
        #[serial]
        fn f32_attention_and_rms_norm_bitwise_equal_reference() {
            let Some(device) = device() else { return };
            super::super::f32_attention_and_rms_norm_equal_reference::<B>(&device);
        }

        #[test]
        #[serial]
        fn f32_sample_tokens_equal_reference() {
            let Some(device) = device() else { return };
            super::super::f32_sample_tokens_equal_reference::<B>(&device);
        }

        /// Past 4096 keys (Sm90: the split forwards, one CTA per split + a merge for decode, each
        /// CTA merging its splits for prefill).
        #[test]
        #[serial]
        fn attention_long_decode_equals_prefill() {
            let Some(device) = device() else { return };
            common::ops::attention_long_decode_equals_prefill::<B>(
                &device,
                burn::tensor::DType::BF16,
            );
        }
    }

    mod fusion {
        use super::super::common;
        type B =
            burn_fusion::Fusion<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>>;
        type AD = burn::backend::Autodiff<B>;
        invariant_testsuite!(B, AD, super::device(), dtypes: [burn::tensor::DType::F32, burn::tensor::DType::BF16], other_dtype: burn::tensor::DType::F16);

        #[test]
        #[serial]
        fn f32_matmul_bitwise_equals_reference() {
            let Some(device) = device() else { return };
            super::super::f32_matmul_equals_reference::<B>(&device);
        }

        #[test]
        #[serial]
        fn f32_attention_and_rms_norm_bitwise_equal_reference() {
            let Some(device) = device() else { return };
            super::super::f32_attention_and_rms_norm_equal_reference::<B>(&device);
        }
    }
}

/// A launch that fails (a kernel NVRTC rejects, forced by `with_rejected_launch`) fails that call
/// and every later call on the device with `DeviceFailed`, never results nothing wrote: the call
/// of a new launch class, where kernels are first compiled, is flushed. In a child process: the
/// failure is for the process's life.
#[cfg(feature = "cuda")]
mod cuda_failed_launch {
    use burn::tensor::{DType, Distribution, Tensor};
    use burn_invariant::InvariantError;

    type B = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

    #[test]
    fn a_failed_launch_fails_that_call_and_every_later_one() {
        let Some(_) = super::common::cuda_device() else {
            return;
        };
        super::common::run_ignored_in_child(
            "cuda_failed_launch::after_a_failed_launch",
            &[],
            &["BURN_INVARIANT_IMPL"],
        );
    }

    #[test]
    #[ignore = "run by a_failed_launch_fails_that_call_and_every_later_one in a child process"]
    fn after_a_failed_launch() {
        let Some(device) = super::common::cuda_device() else {
            return;
        };
        let uniform = Distribution::Uniform(-1.0, 1.0);
        let x = Tensor::<B, 2>::random([5, 37], uniform, (&device, DType::F32));
        let gamma = Tensor::<B, 1>::random([37], uniform, (&device, DType::F32));
        let failed = |result: Result<_, InvariantError>| {
            matches!(result, Err(InvariantError::DeviceFailed { .. }))
        };
        // Before: the call runs.
        let before = burn_invariant::rms_norm(x.clone(), gamma.clone(), 1e-5);
        assert!(before.is_ok(), "{:?}", before.err());
        // A kernel variant fails where it is first compiled: a call of a new class (another D).
        let x2 = Tensor::<B, 2>::random([3, 41], uniform, (&device, DType::F32));
        let gamma2 = Tensor::<B, 1>::random([41], uniform, (&device, DType::F32));
        let call = burn_invariant_cubecl::rms_norm::with_rejected_launch(|| {
            burn_invariant::rms_norm(x2, gamma2, 1e-5)
        });
        assert!(failed(call.clone().map(|_| ())), "got {:?}", call.err());
        // Every later call on the device, of this op or another.
        assert!(failed(
            burn_invariant::rms_norm(x.clone(), gamma, 1e-5).map(|_| ())
        ));
        let w = Tensor::<B, 2>::random([37, 11], uniform, (&device, DType::F32));
        assert!(failed(burn_invariant::matmul(x, w).map(|_| ())));
    }
}

/// ROCm (`CubeBackend<HipRuntime, ..>`, burn-rocm's `Rocm<F>` without fusion): the `CubeCl`
/// kernels, for an f32 and a bf16 float element. Without an AMD device the tests print a notice
/// and pass, unless `BURN_INVARIANT_REQUIRE_ROCM=1`.
#[cfg(feature = "rocm")]
mod rocm {
    pub use super::common::rocm_device as device;

    mod f32 {
        use super::super::common;
        type B = burn_cubecl::CubeBackend<cubecl::hip::HipRuntime, f32, i32, u8>;
        type AD = burn::backend::Autodiff<B>;
        invariant_testsuite!(B, AD, super::device(), dtypes: [burn::tensor::DType::F32, burn::tensor::DType::F16, burn::tensor::DType::BF16], other_dtype: burn::tensor::DType::BF16);

        #[test]
        #[serial]
        fn f32_matmul_bitwise_equals_reference() {
            let Some(device) = device() else { return };
            super::super::f32_matmul_equals_reference::<B>(&device);
        }

        #[test]
        #[serial]
        fn f32_attention_and_rms_norm_bitwise_equal_reference() {
            let Some(device) = device() else { return };
            super::super::f32_attention_and_rms_norm_equal_reference::<B>(&device);
        }
    }

    mod bf16 {
        use super::super::common;
        type B = burn_cubecl::CubeBackend<cubecl::hip::HipRuntime, half::bf16, i32, u8>;
        type AD = burn::backend::Autodiff<B>;
        invariant_testsuite!(B, AD, super::device(), dtypes: [burn::tensor::DType::BF16], other_dtype: burn::tensor::DType::F16);
    }
}

/// Sm90 under Fusion: the Sm90 primitives of `Fusion<CubeBackend<Cuda>>` with inputs made in
/// several ways (fused producers and consumers, slices, gathers: Fusion's outputs are dense,
/// the raw backend's are pitched) give the raw backend's bits.
#[cfg(feature = "cuda")]
mod fusion_sm90 {
    use super::common::{Rng, bits, float};
    use burn::tensor::{DType, Tensor, TensorPrimitive};
    use burn_invariant::InvariantBackend;
    use burn_invariant::registry::Implementation;

    type Raw = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
    type Fused = burn_fusion::Fusion<Raw>;

    fn matmul<B: InvariantBackend>(l: Tensor<B, 2>, r: Tensor<B, 2>) -> Tensor<B, 2> {
        Tensor::from_primitive(TensorPrimitive::Float(B::invariant_matmul(
            l.into_primitive().tensor(),
            r.into_primitive().tensor(),
            None,
            Implementation::Sm90,
        )))
    }

    #[test]
    #[serial_test::serial]
    fn sm90_primitives_under_fusion_match_the_raw_backend() {
        let Some(device) = super::cuda::device() else {
            return;
        };
        let (m, k, n) = (200, 136, 264);
        let mut rng = Rng::new(7);
        let (a, b) = (rng.vec(m * k, 1.0), rng.vec(k * n, 1.0));
        let dt = DType::BF16;
        let expected = bits(matmul::<Raw>(
            float(a.clone(), [m, k], &device, dt),
            float(b.clone(), [k, n], &device, dt),
        ));
        let fl = |v: &Vec<f32>, s: [usize; 2]| float::<Fused, 2>(v.clone(), s, &device, dt);
        let variants: Vec<(&str, Vec<u64>)> = vec![
            ("from_data", bits(matmul(fl(&a, [m, k]), fl(&b, [k, n])))),
            (
                "fused producers",
                bits(matmul(fl(&a, [m, k]) * 1.0, fl(&b, [k, n]) * 1.0)),
            ),
            (
                "fused consumer",
                bits(matmul(fl(&a, [m, k]), fl(&b, [k, n])) + 0.0),
            ),
            ("synced inputs", {
                let (x, y) = (fl(&a, [m, k]), fl(&b, [k, n]));
                let _ = (x.clone().into_data(), y.clone().into_data());
                bits(matmul(x, y))
            }),
            ("raw inputs registered", {
                let x: Tensor<Raw, 2> = float(a.clone(), [m, k], &device, dt);
                let y: Tensor<Raw, 2> = float(b.clone(), [k, n], &device, dt);
                bits(matmul(
                    Tensor::<Fused, 2>::from_data(x.into_data(), (&device, dt)),
                    Tensor::<Fused, 2>::from_data(y.into_data(), (&device, dt)),
                ))
            }),
        ];
        // The suite's failing case under Fusion: chunked rows, several products queued.
        let (m2, k2, n2) = (37, 53, 29);
        let (a2, b2) = (rng.vec(m2 * k2, 1.0), rng.vec(k2 * n2, 1.0));
        let raw_l: Tensor<Raw, 2> = float(a2.clone(), [m2, k2], &device, dt);
        let raw_r: Tensor<Raw, 2> = float(b2.clone(), [k2, n2], &device, dt);
        let expected2 = bits(matmul(raw_l, raw_r));
        let (fl2, fr2) = (fl(&a2, [m2, k2]), fl(&b2, [k2, n2]));
        let cuts = [0, 11, 30, m2];
        let queued: Vec<Tensor<Fused, 2>> = cuts
            .windows(2)
            .map(|w| matmul(fl2.clone().slice([w[0]..w[1], 0..k2]), fr2.clone()))
            .collect();
        let one_by_one: Vec<u64> = cuts
            .windows(2)
            .flat_map(|w| bits(matmul(fl2.clone().slice([w[0]..w[1], 0..k2]), fr2.clone())))
            .collect();
        let materialized: Vec<u64> = cuts
            .windows(2)
            .flat_map(|w| {
                let piece = fl2.clone().slice([w[0]..w[1], 0..k2]);
                let piece = Tensor::<Fused, 2>::from_data(piece.into_data(), (&device, dt));
                bits(matmul(piece, fr2.clone()))
            })
            .collect();
        // The suite picks rows with `select` (a gather), not `slice`.
        let gathered: Vec<u64> = cuts
            .windows(2)
            .flat_map(|w| {
                let rows: Vec<i64> = (w[0] as i64..w[1] as i64).collect();
                let index = super::common::ints::<Fused>(rows, &device);
                bits(matmul(fl2.clone().select(0, index), fr2.clone()))
            })
            .collect();
        let whole = bits(matmul(fl2.clone(), fr2.clone()));
        let queued: Vec<u64> = queued.into_iter().flat_map(bits).collect();
        let mut failed = Vec::new();
        for (name, got) in [
            ("37x53x29 whole", &whole),
            ("37x53x29 chunks queued", &queued),
            ("37x53x29 chunks one by one", &one_by_one),
            ("37x53x29 chunks materialized", &materialized),
            ("37x53x29 chunks gathered", &gathered),
        ] {
            let differ = got.iter().zip(&expected2).filter(|(g, e)| g != e).count();
            let rows: Vec<usize> = (0..m2)
                .filter(|r| (0..n2).any(|c| got[r * n2 + c] != expected2[r * n2 + c]))
                .collect();
            eprintln!(
                "fusion sm90 {name}: {differ}/{} differ, rows {rows:?}",
                got.len()
            );
            if differ > 0 {
                failed.push(name);
            }
        }
        for (name, got) in &variants {
            let differ = got.iter().zip(&expected).filter(|(g, e)| g != e).count();
            let first = got.iter().zip(&expected).position(|(g, e)| g != e);
            eprintln!(
                "fusion sm90 matmul [{m}x{k}]·[{k}x{n}] {name}: {differ}/{} differ, first at {first:?} (got {:?}, expected {:?})",
                expected.len(),
                first.map(|i| f64::from_bits(got[i])),
                first.map(|i| f64::from_bits(expected[i]))
            );
            if differ > 0 {
                failed.push(*name);
            }
        }
        assert!(failed.is_empty(), "Sm90 under Fusion differs: {failed:?}");
    }
}

/// Row invariance (docs/CONTRACT.md, *Invariance*) at production size on the GPU: a row's bits
/// do not depend on whether it is scored alone (M = 1), in a batch of 4096, or in
/// chunked-prefill pieces cut off tile boundaries.
#[cfg(feature = "cuda")]
mod cuda_large_batch {
    use super::common::{Rng, assert_bits_eq, bits, float, ints};
    use burn::tensor::{DType, Tensor};
    use burn_invariant::LinearLogpOptions;
    use serial_test::serial;

    type Raw = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
    const M: usize = 4096;
    const CUTS: [usize; 4] = [0, 1000, 3333, M];
    const PROBES: [usize; 4] = [0, 1, 2047, M - 1];

    #[test]
    #[serial]
    fn matmul_rows_match_for_m1_m4096_and_prefill_chunks() {
        let Some(device) = super::cuda::device() else {
            return;
        };
        let (k, n) = (1000, 1368);
        let mut rng = Rng::new(99);
        let (a, b) = (rng.vec(M * k, 1.0), rng.vec(k * n, 0.05));
        for dtype in [DType::BF16, DType::F16] {
            let lhs: Tensor<Raw, 2> = float(a.clone(), [M, k], &device, dtype);
            let rhs: Tensor<Raw, 2> = float(b.clone(), [k, n], &device, dtype);
            let full = burn_invariant::matmul(lhs.clone(), rhs.clone()).unwrap();
            for row in PROBES {
                let alone =
                    burn_invariant::matmul(lhs.clone().slice([row..row + 1, 0..k]), rhs.clone())
                        .unwrap();
                assert_bits_eq(
                    &format!("{dtype:?} row {row}: M=1 vs M={M}"),
                    &bits(alone),
                    &bits(full.clone().slice([row..row + 1, 0..n])),
                );
            }
            let chunks: Vec<Tensor<Raw, 2>> = CUTS
                .windows(2)
                .map(|w| {
                    burn_invariant::matmul(lhs.clone().slice([w[0]..w[1], 0..k]), rhs.clone())
                        .unwrap()
                })
                .collect();
            assert_bits_eq(
                &format!("{dtype:?}: chunks {CUTS:?} vs one call"),
                &bits(Tensor::cat(chunks, 0)),
                &bits(full),
            );
        }
    }

    #[test]
    #[serial]
    fn linear_logp_rows_match_for_n1_n4096_and_prefill_chunks() {
        let Some(device) = super::cuda::device() else {
            return;
        };
        let (d, v) = (264, 5003);
        let mut rng = Rng::new(98);
        let hidden = rng.vec(M * d, 1.0);
        let weight = rng.vec(v * d, 0.2);
        let targets: Vec<i64> = (0..M).map(|_| rng.below(v) as i64).collect();
        let dtype = DType::BF16;
        let h: Tensor<Raw, 2> = float(hidden, [M, d], &device, dtype);
        let w: Tensor<Raw, 2> = float(weight, [v, d], &device, dtype);
        let t = ints::<Raw>(targets, &device);
        let options = LinearLogpOptions::default();
        let run = |rows: core::ops::Range<usize>| {
            let (logp, lse) = burn_invariant::linear_logp_with_lse(
                h.clone().slice([rows.clone(), 0..d]),
                w.clone(),
                t.clone().slice(rows),
                None,
                &options,
            )
            .unwrap();
            (bits(logp), bits(lse))
        };
        let (logp, lse) = run(0..M);
        for row in PROBES {
            let (l, s) = run(row..row + 1);
            assert_bits_eq(
                &format!("logp row {row}: N=1 vs N={M}"),
                &l,
                &logp[row..=row],
            );
            assert_bits_eq(&format!("lse row {row}: N=1 vs N={M}"), &s, &lse[row..=row]);
        }
        let (mut cl, mut cs) = (Vec::new(), Vec::new());
        for w in CUTS.windows(2) {
            let (l, s) = run(w[0]..w[1]);
            cl.extend(l);
            cs.extend(s);
        }
        assert_bits_eq(&format!("logp chunks {CUTS:?}"), &cl, &logp);
        assert_bits_eq(&format!("lse chunks {CUTS:?}"), &cs, &lse);
    }
}
