//! A launch sweep for code-generation checks: every kernel of the crate, at every compile-time
//! variant the crate picks on the given client, launched once through the public functions.
//!
//! Nothing is read back or checked: a runtime that compiles kernels instead of running them
//! (CUDA / HIP source from a recording server) hands every variant to the compiler checks, and a
//! real device at least runs each variant once. Buffers are allocated with `client.empty` and hold
//! whatever the runtime gives; the kernels guard every index, so no value can send them out of
//! bounds. Every `Result` is unwrapped with the variant in the message: a refused launch is a
//! failure, never a skip.
//!
//! What is compile-time and what triggers it:
//! * the client decides dtypes (f32 always; f16 / bf16 where `runtime_supports`), targets (i32;
//!   i64 where supported), `fma` fused or emulated (`fma_mode`), tensor cores (`matmul_path`,
//!   `linear_logp_tensor_cores`, `attention_forward_uses_tensor_cores`), manual MMA, the `cp.async`
//!   ring, the plane width and the RMSNorm vector widths (`io_optimized_vector_sizes`);
//! * shapes and strides decide the rest: cmma staging orientation and 16-byte loads, attention
//!   head size and rows per unit, RMSNorm vector width, chunk accumulation in the `linear_logp`
//!   backward.

use burn_invariant_cubecl::attention::{
    ATTENTION_KEY_SPLIT, AttentionGradRefs, AttentionRefs, SplitExecution, attention_backward,
    attention_backward_workspace_len, attention_forward_uses_tensor_cores, attention_forward_with,
    attention_math_on_device, with_async_staging,
};
use burn_invariant_cubecl::consts::{CMMA_TILE, CmmaTile};
use burn_invariant_cubecl::gemm::{fma_emulated_on_device, matmul_cmma_tiled};
use burn_invariant_cubecl::logp::{
    SampleSpec, linear_sample_forward, linear_sample_workspace_len, linear_top_k_forward,
};
use burn_invariant_cubecl::rms_norm::with_two_pass_backward;
use burn_invariant_cubecl::tp::{self, GlobalTargets};
use burn_invariant_cubecl::{
    FloatDType, GemmPath, IndexDType, KernelError, LogpGradRefs, LogpInputRefs, RmsNormGradRefs,
    RmsNormRefs, col_sum, linear_logp_backward, linear_logp_backward_workspace_len,
    linear_logp_forward, linear_logp_forward_workspace_len, linear_logp_tensor_cores, matmul,
    matmul_path, matmul_row_reduction, rms_norm_backward, rms_norm_backward_workspace_len,
    rms_norm_forward, runtime_supports, with_chunked_fma,
};
use cubecl::prelude::*;
use cubecl::zspace::{Shape, Strides};

/// Launches every kernel of this crate at every comptime variant the crate can launch on a client
/// with these properties (dtype f32/f16/bf16, FMA and tensor-core (cmma / manual mma) paths,
/// vector widths, head dims, tc vs FMA attention forward, emulated and fused FMA where the crate
/// launches both, etc.). Returns the number of public launch calls made.
pub fn launch_every_variant<R: Runtime>(client: &ComputeClient<R>) -> usize {
    let mut s = Sweep::new(client);
    s.gemm();
    s.logp();
    s.sample();
    s.attention();
    s.rms_norm();
    s.tp();
    s.helpers();
    // Launches that a runtime compiles or runs asynchronously report their errors by now.
    cubecl::future::block_on(client.sync())
        .unwrap_or_else(|e| panic!("launch sweep: the runtime failed: {e:?}"));
    s.calls
}

/// Sizes of a GEMM on the cmma path: multiples of the 8-element (16-byte) load, of no tile, so
/// that only the strides decide the load width.
const CMMA_MKN: [usize; 3] = [40, 72, 152];

/// Attention head sizes of the FMA kernels (compile-time): 0 (no column chunk), 8 (a partial
/// 16-deep stage only), 16 (one whole stage, one 32-column chunk), 40 (whole and partial stages),
/// 64 and 128 (the usual heads), 136 (the dK/dV kernel's 2-rows-per-unit tiling, > 128), 256 (the
/// largest accepted).
const ATTN_HEAD_DIMS: [usize; 8] = [0, 8, 16, 40, 64, 128, 136, 256];

/// What an attention call of the sweep launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    /// The forward, by this split execution.
    Forward(SplitExecution),
    /// The forward, then the backward.
    Both,
}

/// `(batch, heads, kv_heads, q_len, kv_len)` of the attention calls; the query rows of a KV group
/// (`heads / kv_heads · q_len`) pick the rows per unit of the forward and dQ kernels (`≤ 16`: 1,
/// `≤ 32`: 2, else 4) and, on tensor cores, the split tiling (`≤ 16` with head 64 / 128).
const ATTN_SHAPES: [[usize; 5]; 3] = [
    [2, 2, 2, 5, 37],  // group 1 × 5 rows: 1 row per unit; tc split
    [2, 4, 2, 10, 37], // GQA, group 2 × 10 rows: 2 rows per unit
    [1, 4, 1, 9, 70],  // GQA, group 4 × 9 rows: 4 rows per unit; tc 64-row tiles
];

/// One `linear_logp` call: sizes, layouts (`*_t`: the column-major view of the logical matrix)
/// and the compile-time switches.
#[derive(Clone, Copy, Debug)]
struct LogpCase {
    n: usize,
    d: usize,
    v: usize,
    hidden_t: bool,
    weight_t: bool,
    bias: bool,
    targets: IndexDType,
    ignore: bool,
    entropy: bool,
}

impl LogpCase {
    /// Row-major operands, i32 targets, no bias, no ignore index, no entropy.
    fn plain(n: usize, d: usize, v: usize) -> Self {
        LogpCase {
            n,
            d,
            v,
            hidden_t: false,
            weight_t: false,
            bias: false,
            targets: IndexDType::I32,
            ignore: false,
            entropy: false,
        }
    }

    /// Rows past the tensor-core backward's row chunk (2048) and a vocabulary past its chunk
    /// (4096), with a bias: the accumulating GEMMs of that backward. `v − 4096` a multiple of 8:
    /// 16-byte loads of `dz` in the second vocabulary chunk.
    fn large(d: usize, v: usize) -> Self {
        LogpCase {
            bias: true,
            ..LogpCase::plain(2050, d, v)
        }
    }
}

struct Sweep<'a, R: Runtime> {
    client: &'a ComputeClient<R>,
    calls: usize,
    floats: Vec<FloatDType>,
    ints: Vec<IndexDType>,
}

impl<'a, R: Runtime> Sweep<'a, R> {
    fn new(client: &'a ComputeClient<R>) -> Self {
        let supported = |st| runtime_supports(client, st);
        assert!(
            supported(FloatDType::F32.storage()) && supported(IndexDType::I32.storage()),
            "launch sweep: the runtime must support f32 and i32"
        );
        // f16 / bf16 / i64 where the runtime has them (the launches would refuse them elsewhere).
        let floats = [FloatDType::F32, FloatDType::F16, FloatDType::BF16]
            .into_iter()
            .filter(|dt| supported(dt.storage()))
            .collect();
        let ints = [IndexDType::I32, IndexDType::I64]
            .into_iter()
            .filter(|it| supported(it.storage()))
            .collect();
        Sweep {
            client,
            calls: 0,
            floats,
            ints,
        }
    }

    /// Counts one public launch call and fails loudly, naming the variant, where it was refused.
    fn done<T>(&mut self, result: Result<T, KernelError>, what: impl FnOnce() -> String) -> T {
        self.calls += 1;
        result.unwrap_or_else(|e| panic!("launch sweep: {} refused: {e}", what()))
    }

    /// A view of `shape` / `strides` over a fresh buffer that holds exactly the addressed span
    /// (at least 16 bytes: empty views still get a buffer).
    fn view(&self, shape: &[usize], strides: &[usize], elem: usize) -> TensorBinding<R> {
        let span = if shape.contains(&0) {
            0
        } else {
            1 + shape
                .iter()
                .zip(strides)
                .map(|(s, st)| (s - 1) * st)
                .sum::<usize>()
        };
        let handle = self.client.empty((span * elem).max(16));
        unsafe {
            TensorBinding::from_raw_parts(
                handle,
                Strides::new(strides),
                Shape::from(shape.to_vec()),
            )
        }
    }

    /// A contiguous row-major view of `shape`.
    fn dense(&self, shape: &[usize], elem: usize) -> TensorBinding<R> {
        let mut strides = vec![1; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        self.view(shape, &strides, elem)
    }

    /// A `[rows, cols]` matrix, contiguous along its columns (`inner_last`) or its rows, whose
    /// other stride is padded by one element unless `vec` (so 16-byte loads need `vec` and an
    /// extent that is a multiple of 8).
    fn mat(
        &self,
        [rows, cols]: [usize; 2],
        inner_last: bool,
        vec: bool,
        elem: usize,
    ) -> TensorBinding<R> {
        let pad = usize::from(!vec);
        let strides = if inner_last {
            [cols + pad, 1]
        } else {
            [1, rows + pad]
        };
        self.view(&[rows, cols], &strides, elem)
    }

    // ---------------------------------------------------------------------------------------
    // GEMM: gemm_fma_kernel<A, B, O>{bias, accumulate, skip zero, emulate}, gemm_cmma_kernel<F, O,
    // VA, VB>{bias, accumulate, orientation, tiling, manual, ring}, col_sum, cast.

    fn gemm(&mut self) {
        for dt in self.floats.clone() {
            let st = dt.storage();
            let [_, k, n] = CMMA_MKN;
            let path = matmul_path(self.client, st, k, n)
                .unwrap_or_else(|e| panic!("launch sweep: matmul_path {dt:?}: {e}"));
            match path {
                GemmPath::Fma => {
                    for bias in [false, true] {
                        self.matmul_fma(dt, bias);
                    }
                }
                GemmPath::Cmma { manual_mma, .. } => {
                    self.matmul_cmma(dt);
                    if manual_mma {
                        self.cmma_tilings(dt);
                    }
                }
            }
            // Always the FMA kernel, skipping zero rhs terms.
            let es = dt.size();
            let (m, k, n) = (37, 20, 70);
            let lhs_t = self.view(&[k, m], &[1, k], es);
            let dout = self.dense(&[m, n], es);
            let out = self.dense(&[k, n], es);
            let r = matmul_row_reduction(self.client, &lhs_t, &dout, &out, st);
            self.done(r, || format!("matmul_row_reduction {dt:?}"));
            let x = self.dense(&[37, 150], es);
            let out = self.dense(&[150], es);
            let r = col_sum(self.client, &x, &out, st);
            self.done(r, || format!("col_sum {dt:?}"));
        }
    }

    /// `matmul` where it runs the FMA kernel (the layout is a runtime choice there).
    fn matmul_fma(&mut self, dt: FloatDType, bias: bool) {
        let (es, (m, k, n)) = (dt.size(), (37, 150, 70));
        let lhs = self.dense(&[m, k], es);
        let rhs = self.view(&[k, n], &[1, k], es);
        let b = self.dense(&[n], es);
        let out = self.dense(&[m, n], es);
        let r = matmul(
            self.client,
            &lhs,
            &rhs,
            bias.then_some(&b),
            &out,
            dt.storage(),
        );
        self.done(r, || format!("matmul fma {dt:?} bias {bias}"));
    }

    /// `matmul` on the cmma path: every staging orientation of both operands × scalar or 16-byte
    /// loads of each (both 16-byte: the `cp.async` ring where the client has it), the bias
    /// alternating so that each value meets every other axis.
    fn matmul_cmma(&mut self, dt: FloatDType) {
        let (es, [m, k, n]) = (dt.size(), CMMA_MKN);
        for a_kfast in [true, false] {
            for b_nfast in [true, false] {
                for va in [false, true] {
                    for vb in [false, true] {
                        let bias = a_kfast ^ b_nfast ^ va ^ vb;
                        let lhs = self.mat([m, k], a_kfast, va, es);
                        let rhs = self.mat([k, n], b_nfast, vb, es);
                        let b = self.dense(&[n], es);
                        let out = self.dense(&[m, n], es);
                        let r = matmul(
                            self.client,
                            &lhs,
                            &rhs,
                            bias.then_some(&b),
                            &out,
                            dt.storage(),
                        );
                        self.done(r, || {
                            format!(
                                "matmul cmma {dt:?} a_kfast {a_kfast} b_nfast {b_nfast} \
                                 16-byte a {va} b {vb} bias {bias}"
                            )
                        });
                    }
                }
            }
        }
    }

    /// Where `matmul` drives the MMAs by hand (CUDA), the kernels it never picks there:
    /// WMMA fragments (`manual_mma = false`, what other runtimes run), the register-pipelined
    /// kernel with manual MMAs and 16-byte loads (what devices without the ring's shared memory
    /// run: a one-stage tiling disables the ring), and the ring with lag 1 and with a 3-deep
    /// lag-2 ring.
    fn cmma_tilings(&mut self, dt: FloatDType) {
        let (es, [m, k, n]) = (dt.size(), CMMA_MKN);
        let no_ring = CmmaTile {
            stages: 1,
            lag: 1,
            ..CMMA_TILE
        };
        let ring_lag1 = CmmaTile {
            stages: 2,
            lag: 1,
            ..CMMA_TILE
        };
        let ring_lag2 = CmmaTile {
            stages: 3,
            lag: 2,
            ..CMMA_TILE
        };
        let mut runs = Vec::new();
        for a_kfast in [true, false] {
            for b_nfast in [true, false] {
                let o = (a_kfast, b_nfast);
                runs.push((o, false, false, CMMA_TILE));
                runs.push((o, true, false, CMMA_TILE));
                runs.push((o, true, true, no_ring));
                runs.push((o, true, true, ring_lag1));
            }
        }
        runs.push(((true, false), true, true, ring_lag2));
        for ((a_kfast, b_nfast), vec, manual, tile) in runs {
            let lhs = self.mat([m, k], a_kfast, vec, es);
            let rhs = self.mat([k, n], b_nfast, vec, es);
            let out = self.dense(&[m, n], es);
            let r = matmul_cmma_tiled(self.client, &lhs, &rhs, &out, dt.storage(), tile, manual);
            self.done(r, || {
                format!(
                    "matmul_cmma_tiled {dt:?} a_kfast {a_kfast} b_nfast {b_nfast} 16-byte {vec} \
                     manual {manual} {tile:?}"
                )
            });
        }
    }

    // ---------------------------------------------------------------------------------------
    // linear_logp. FMA path: logp_partial_kernel / logp_dz_kernel <F, I>{bias, ignore, entropy,
    // emulate}, logp_merge_kernel <I>{ignore, entropy}, FMA GEMMs <f32, F, f32>{accumulate, skip},
    // col_sum, cast. Tensor-core path: the cmma GEMMs with f32 output {bias, accumulate,
    // orientation, loads, ring}, logp_scan / logp_mask_hidden / logp_dz_from_logits <(F,) I>
    // {ignore, entropy}.

    fn logp(&mut self) {
        for dt in self.floats.clone() {
            let tc = dt != FloatDType::F32 && linear_logp_tensor_cores(self.client, dt.storage());
            // f16 / bf16 take the FMA kernels only without tensor cores, or with D = 0 (nothing
            // to multiply).
            self.logp_fma_path(dt, if tc { 0 } else { 37 });
            if tc {
                self.logp_tc_path(dt, true);
                // The test hook's FMA GEMMs in the tensor-core chunks (<F, F, f32>).
                with_chunked_fma(|| {
                    for bias in [false, true] {
                        let case = LogpCase {
                            bias,
                            ..LogpCase::plain(37, 37, 150)
                        };
                        self.logp_call(dt, case, false);
                    }
                    self.logp_call(dt, LogpCase::large(8, 4104), false);
                });
            } else if dt != FloatDType::F32 {
                // The tensor-core path's own kernels, with FMA GEMMs (the test hook).
                with_chunked_fma(|| self.logp_tc_path(dt, false));
            }
        }
    }

    /// Every (bias, ignore, entropy) with i32 targets; with i64 targets, the four combinations
    /// that meet each pair of values of two switches.
    fn logp_switches(&self) -> Vec<(IndexDType, bool, bool, bool)> {
        let mut out = Vec::new();
        for bias in [false, true] {
            for ignore in [false, true] {
                for entropy in [false, true] {
                    out.push((IndexDType::I32, bias, ignore, entropy));
                }
            }
        }
        if self.ints.contains(&IndexDType::I64) {
            for (bias, ignore, entropy) in [
                (false, false, false),
                (true, true, false),
                (true, false, true),
                (false, true, true),
            ] {
                out.push((IndexDType::I64, bias, ignore, entropy));
            }
        }
        out
    }

    fn logp_fma_path(&mut self, dt: FloatDType, d: usize) {
        for (targets, bias, ignore, entropy) in self.logp_switches() {
            let case = LogpCase {
                bias,
                targets,
                ignore,
                entropy,
                ..LogpCase::plain(37, d, 150)
            };
            self.logp_call(dt, case, true);
        }
        if d > 0 {
            // Crosses the backward's row (256) and vocabulary (4096) chunks: the accumulating
            // FMA GEMMs and column sums.
            let case = LogpCase {
                bias: true,
                ignore: true,
                ..LogpCase::plain(300, 8, 4100)
            };
            self.logp_call(dt, case, false);
        }
    }

    /// The tensor-core path (or its chunks with FMA GEMMs under `with_chunked_fma`).
    fn logp_tc_path(&mut self, dt: FloatDType, large: bool) {
        // The switches of the scan and element-wise kernels, at 16-byte aligned sizes.
        for (targets, bias, ignore, entropy) in self.logp_switches() {
            let case = LogpCase {
                bias,
                targets,
                ignore,
                entropy,
                ..LogpCase::plain(37, 64, 160)
            };
            self.logp_call(dt, case, true);
        }
        // The cmma GEMMs' orientations and load widths: logits (hidden · weightᵀ: hidden
        // K-contiguous unless transposed, weightᵀ N-contiguous where the weight is transposed),
        // dHidden (dz · weight) and dWeight (dzᵀ · hidden): 16-byte loads where D, V (and N for
        // a transposed hidden) are multiples of 8.
        let shapes = [
            (37, 37, 150, false, false), // all scalar loads
            (37, 64, 150, false, false), // logits 16-byte (ring); dz scalar
            (37, 37, 160, false, false), // logits scalar; dz 16-byte
            (37, 64, 160, false, true),  // weight transposed: logits both N-contiguous
            (40, 64, 160, true, false),  // hidden transposed: logits lhs M-contiguous
            (40, 64, 160, true, true),   // both transposed, 16-byte
            (37, 37, 150, true, true),   // both transposed, scalar
        ];
        for (n, d, v, hidden_t, weight_t) in shapes {
            for bias in [false, true] {
                let case = LogpCase {
                    hidden_t,
                    weight_t,
                    bias,
                    ..LogpCase::plain(n, d, v)
                };
                self.logp_call(dt, case, false);
            }
        }
        if large {
            // Accumulating GEMMs: 16-byte loads (the ring where the client has it), scalar
            // loads (D = 12, V − 4096 = 4), and dHidden's weight K-contiguous (transposed).
            self.logp_call(dt, LogpCase::large(8, 4104), false);
            self.logp_call(dt, LogpCase::large(12, 4100), false);
            let weight_t = LogpCase {
                weight_t: true,
                ..LogpCase::large(8, 4104)
            };
            self.logp_call(dt, weight_t, false);
        }
    }

    /// The backward of `case`, after its forward when `forward`.
    fn logp_call(&mut self, dt: FloatDType, case: LogpCase, forward: bool) {
        let LogpCase { n, d, v, .. } = case;
        let (st, es) = (dt.storage(), dt.size());
        let hidden = if case.hidden_t {
            self.view(&[n, d], &[1, n], es)
        } else {
            self.dense(&[n, d], es)
        };
        let weight = if case.weight_t {
            self.view(&[v, d], &[1, v], es)
        } else {
            self.dense(&[v, d], es)
        };
        let bias = self.dense(&[v], es);
        let targets = self.dense(&[n], case.targets.size());
        let inputs = LogpInputRefs {
            hidden: &hidden,
            weight: &weight,
            bias: case.bias.then_some(&bias),
            targets: &targets,
            targets_dtype: case.targets.storage(),
            ignore_index: case.ignore.then_some(-100),
            dtype: st,
            // A runtime scalar: any finite positive value.
            inv_temperature: if case.entropy { 0.5 } else { 1.0 },
            entropy: case.entropy,
        };
        let cols = inputs.stats_columns();
        let stats = self.dense(&[n, cols], 4);
        if forward {
            let ws = self.dense(&[linear_logp_forward_workspace_len(n, v, st)], 4);
            let r = linear_logp_forward(self.client, &inputs, &stats, &ws);
            self.done(r, || format!("linear_logp_forward {dt:?} {case:?}"));
        }
        let grad = self.dense(&[n, cols], 4);
        let d_hidden = self.dense(&[n, d], es);
        let d_weight = self.dense(&[v, d], es);
        let d_bias = self.dense(&[v], es);
        let grads = LogpGradRefs {
            d_hidden: &d_hidden,
            d_weight: &d_weight,
            d_bias: case.bias.then_some(&d_bias),
        };
        let len = linear_logp_backward_workspace_len(n, d, v, st, case.bias)
            .unwrap_or_else(|e| panic!("launch sweep: backward workspace {dt:?} {case:?}: {e}"));
        let ws = self.dense(&[len], 4);
        let r = linear_logp_backward(self.client, &inputs, &stats, &grad, &grads, &ws);
        self.done(r, || format!("linear_logp_backward {dt:?} {case:?}"));
    }

    // ---------------------------------------------------------------------------------------
    // linear_sample: logp_partial_kernel <F, I>{.., pick k 1 | 5 | 64, noise} (FMA path),
    // chunk_candidates_kernel <I>{k 1, noise} and chunk_top_k_kernel {k} (tensor-core path),
    // sample_merge_kernel <I>{entropy, pick}. linear_top_k: the same pass without noise (k 1 | 5 |
    // 64), top_k_merge_kernel {k}.

    fn sample(&mut self) {
        for dt in self.floats.clone() {
            let tc = dt != FloatDType::F32 && linear_logp_tensor_cores(self.client, dt.storage());
            self.sample_calls(dt, if tc { 64 } else { 37 });
            if !tc && dt != FloatDType::F32 {
                // The tensor-core path's own kernels, with FMA GEMMs (the test hook).
                with_chunked_fma(|| self.sample_calls(dt, 64));
            }
        }
    }

    /// Gumbel-max, greedy, top-5 and top-64, each with and without bias and entropy (keys i32,
    /// and i64 once where the client has it).
    fn sample_calls(&mut self, dt: FloatDType, d: usize) {
        let mut keys = vec![IndexDType::I32];
        if self.ints.contains(&IndexDType::I64) {
            keys.push(IndexDType::I64);
        }
        for (k, noise) in [(1, true), (1, false), (5, true), (64, true)] {
            for (bias, entropy) in [(false, false), (true, true)] {
                for &key in &keys {
                    let spec = SampleSpec { seed: 7, k, noise };
                    self.sample_call(SampleCase {
                        dt,
                        d,
                        bias,
                        entropy,
                        keys: key,
                        spec,
                        lists: false,
                    });
                }
            }
        }
        for k in [1, 5, 64] {
            for bias in [false, true] {
                for &key in &keys {
                    let spec = SampleSpec {
                        seed: 0,
                        k,
                        noise: false,
                    };
                    self.sample_call(SampleCase {
                        dt,
                        d,
                        bias,
                        entropy: false,
                        keys: key,
                        spec,
                        lists: true,
                    });
                }
            }
        }
    }

    /// One `[37, d, 160]` sampler launch of `case`.
    fn sample_call(&mut self, case: SampleCase) {
        let SampleCase {
            dt,
            d,
            bias,
            entropy,
            keys,
            spec,
            lists,
        } = case;
        let (n, v) = (37, 160);
        let (st, es) = (dt.storage(), dt.size());
        let hidden = self.dense(&[n, d], es);
        let weight = self.dense(&[v, d], es);
        let bias_buf = self.dense(&[v], es);
        let key_buf = self.dense(&[n], keys.size());
        let inputs = LogpInputRefs {
            hidden: &hidden,
            weight: &weight,
            bias: bias.then_some(&bias_buf),
            targets: &key_buf,
            targets_dtype: keys.storage(),
            ignore_index: None,
            dtype: st,
            inv_temperature: 0.5,
            entropy,
        };
        let ws = self.dense(&[linear_sample_workspace_len(n, v, st, spec.k)], 4);
        let (r, what) = if lists {
            let out = self.dense(&[n, 2 * spec.k as usize], 4);
            let r = linear_top_k_forward(self.client, &inputs, spec.k, &out, &ws);
            (r, "linear_top_k_forward")
        } else {
            let out = self.dense(&[n, inputs.stats_columns() + 1], 4);
            let r = linear_sample_forward(self.client, &inputs, spec, &out, &ws);
            (r, "linear_sample_forward")
        };
        self.done(r, || {
            format!("{what} {dt:?} {spec:?} bias {bias} entropy {entropy} {keys:?}")
        });
    }

    // ---------------------------------------------------------------------------------------
    // Attention. FMA: attention_forward_kernel / attention_dq_kernel <F>{d, rows 1|2|4, causal,
    // emulate}, attention_delta_kernel <F>{d, rows 1, ..}, attention_dkv_kernel <F>{d, rows 4
    // (d ≤ 128) | 2, ..}. Tensor cores (f16 / bf16 forward, head sizes multiples of 16 up to 128
    // where the client has manual MMA): attention_tc_forward_kernel <F, N>{d, causal, emulate,
    // split, vec, async_copy, warps} (16-byte loads on dense tensors, scalar ones where a row
    // stride is d + 4; K and V staged through registers, and again copied by `cp.async` in cubes of
    // 4 or 12 warps under `with_async_staging`).

    fn attention(&mut self) {
        for dt in self.floats.clone() {
            // Each head size twice: non-causal and causal, the rows per unit cycling so that
            // every (rows, causal) pair appears.
            for (i, d) in ATTN_HEAD_DIMS.into_iter().enumerate() {
                for (j, causal) in [false, true].into_iter().enumerate() {
                    self.attention_call(dt, d, ATTN_SHAPES[(i + j) % 3], causal, true);
                }
            }
            self.attention_splits(dt);
            self.attention_tensor_cores(dt);
            with_async_staging(|| self.attention_tensor_cores(dt));
        }
    }

    /// Every head size of the tensor-core forward (and its backward), both tilings, and its
    /// splits folded in the cube and by parts + merge.
    fn attention_tensor_cores(&mut self, dt: FloatDType) {
        for d in (16..=128).step_by(16) {
            if !attention_forward_uses_tensor_cores(self.client, dt, d) {
                continue;
            }
            for causal in [false, true] {
                self.attention_call(dt, d, ATTN_SHAPES[2], causal, true);
                if d % 64 == 0 {
                    self.attention_call(dt, d, ATTN_SHAPES[0], causal, false);
                }
            }
            // Query rows d + 4 apart: scalar loads; a negative scale.
            self.attention_call_padded(dt, d, ATTN_SHAPES[2], true, 4);
        }
        let kv = ATTENTION_KEY_SPLIT + 100;
        for d in (16..=128).step_by(16) {
            if !attention_forward_uses_tensor_cores(self.client, dt, d) {
                continue;
            }
            for causal in [false, true] {
                for shape in [ATTN_SHAPES[2], ATTN_SHAPES[0]] {
                    let [b, h, kh, q, _] = shape;
                    for ex in [SplitExecution::InCube, SplitExecution::Parts] {
                        let pass = Pass::Forward(ex);
                        self.attention_call_inner(dt, d, [b, h, kh, q, kv], causal, pass, 0);
                    }
                }
            }
        }
    }

    /// Keys past one split: the FMA forward folding splits at every head size (causal
    /// alternating).
    fn attention_splits(&mut self, dt: FloatDType) {
        let kv = ATTENTION_KEY_SPLIT + 100;
        for (i, d) in ATTN_HEAD_DIMS.into_iter().enumerate() {
            let [b, h, kh, q, _] = ATTN_SHAPES[i % 3];
            let shape = [b, h, kh, q, kv];
            let pass = Pass::Forward(SplitExecution::Auto);
            self.attention_call_inner(dt, d, shape, i % 2 == 1, pass, 0);
        }
    }

    /// The forward, then (with `backward`) the backward.
    fn attention_call(
        &mut self,
        dt: FloatDType,
        d: usize,
        shape: [usize; 5],
        causal: bool,
        backward: bool,
    ) {
        let pass = if backward {
            Pass::Both
        } else {
            Pass::Forward(SplitExecution::Auto)
        };
        self.attention_call_inner(dt, d, shape, causal, pass, 0);
    }

    /// Forward and backward with the query's rows `d + pad` apart and scale −0.125.
    fn attention_call_padded(
        &mut self,
        dt: FloatDType,
        d: usize,
        shape: [usize; 5],
        causal: bool,
        pad: usize,
    ) {
        self.attention_call_inner(dt, d, shape, causal, Pass::Both, pad);
    }

    fn attention_call_inner(
        &mut self,
        dt: FloatDType,
        d: usize,
        [b, h, kh, q, kv]: [usize; 5],
        causal: bool,
        pass: Pass,
        pad: usize,
    ) {
        let es = dt.size();
        let query = if pad == 0 {
            self.dense(&[b, h, q, d], es)
        } else {
            let row = d + pad;
            self.view(&[b, h, q, d], &[h * q * row, q * row, row, 1], es)
        };
        let key = self.dense(&[b, kh, kv, d], es);
        let value = self.dense(&[b, kh, kv, d], es);
        let kv_lens = self.dense(&[b], 4);
        let inputs = AttentionRefs {
            query: &query,
            key: &key,
            value: &value,
            kv_lens: &kv_lens,
            dtype: dt,
            causal,
            scale: if pad == 0 { 0.125 } else { -0.125 },
        };
        let what = || {
            format!(
                "{dt:?} d {d} shape {:?} causal {causal} query pad {pad}",
                [b, h, kh, q, kv]
            )
        };
        let out = self.dense(&[b, h, q, d], es);
        let lse = self.dense(&[b, h, q], 4);
        let execution = match pass {
            Pass::Forward(execution) => execution,
            Pass::Both => SplitExecution::Auto,
        };
        let r = attention_forward_with(self.client, &inputs, &out, &lse, execution);
        self.done(r, || format!("attention_forward {pass:?} {}", what()));
        if pass != Pass::Both {
            return;
        }
        let grad_out = self.dense(&[b, h, q, d], es);
        let grad_query = self.dense(&[b, h, q, d], es);
        let grad_key = self.dense(&[b, kh, kv, d], es);
        let grad_value = self.dense(&[b, kh, kv, d], es);
        let workspace = self.dense(&[attention_backward_workspace_len(b, h, q)], 4);
        let grads = AttentionGradRefs {
            out: &out,
            lse: &lse,
            grad_out: &grad_out,
            grad_query: &grad_query,
            grad_key: &grad_key,
            grad_value: &grad_value,
            workspace: &workspace,
        };
        let r = attention_backward(self.client, &inputs, &grads);
        self.done(r, || format!("attention_backward {}", what()));
    }

    // ---------------------------------------------------------------------------------------
    // RMSNorm: rms_norm_forward_kernel / rms_norm_dx_kernel <F, N>{w = N, batch, emulate, plane},
    // rms_norm_partials_kernel <F, M = min(w, 2)>, rms_norm_dgamma_kernel <F>,
    // rms_norm_zero_kernel <F>, rms_norm_backward_kernel <F, N>{w = N, rounds, emulate, plane}
    // (plane: the recording client's, so the plane-shuffle trees; shared-memory ones on wgpu). The
    // vector width w is the widest of the client's IO widths of at most 8 bytes that divides D
    // (every operand contiguous and aligned): D = 37 → 1, 150 → 2, 152 → 4 (f16 / bf16; f32
    // stops at 2); the one-pass backward narrows it where its row would not fit its registers.
    // The two-pass kernels run at the small D (forced), the one pass at every rounds bucket
    // (`ceil(D / 256)` up to a power of two, D = 256·(rounds − 1) + 9 / 10 / 12 for w = 1 / 2 / 4,
    // narrowed where a row would not fit the unit's registers), and its fixed-offset variant at
    // whole rounds (D = 256·rounds).

    fn rms_norm(&mut self) {
        for dt in self.floats.clone() {
            let es = dt.size();
            let one_pass = [1usize, 2, 4, 8, 16, 32]
                .into_iter()
                .flat_map(|r| [9usize, 10, 12].map(|e| (5usize, 256 * (r - 1) + e)))
                .chain([1usize, 2, 4, 8, 16, 32].map(|r| (5, 256 * r)));
            let shapes = [(5, 37), (5, 150), (5, 152), (0, 150)].into_iter();
            for (n, d) in shapes.chain(one_pass) {
                let x = self.dense(&[n, d], es);
                let gamma = self.dense(&[d], es);
                let inputs = RmsNormRefs {
                    x: &x,
                    gamma: &gamma,
                    dtype: dt,
                    eps: 1e-6,
                };
                if n > 0 {
                    let out = self.dense(&[n, d], es);
                    let r = rms_norm_forward(self.client, &inputs, &out);
                    self.done(r, || format!("rms_norm_forward {dt:?} [{n}, {d}]"));
                }
                // N = 0: only the kernel that zeroes dGamma.
                let grad_out = self.dense(&[n, d], es);
                let grad_x = self.dense(&[n, d], es);
                let grad_gamma = self.dense(&[d], es);
                let workspace = self.dense(&[rms_norm_backward_workspace_len(n, d)], 4);
                let grads = RmsNormGradRefs {
                    grad_out: &grad_out,
                    grad_x: &grad_x,
                    grad_gamma: &grad_gamma,
                    workspace: &workspace,
                };
                let r = rms_norm_backward(self.client, &inputs, &grads);
                self.done(r, || format!("rms_norm_backward {dt:?} [{n}, {d}]"));
                if d < 256 {
                    let r =
                        with_two_pass_backward(|| rms_norm_backward(self.client, &inputs, &grads));
                    self.done(r, || {
                        format!("rms_norm_backward two-pass {dt:?} [{n}, {d}]")
                    });
                }
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // Tensor-parallel helpers: leaf_targets / finish <I>{ignore}, pick <I>{acc}, merge_lse,
    // merge_entropy.

    fn tp(&mut self) {
        // More rows than one cube of 256.
        let n = 300;
        for it in self.ints.clone() {
            let (st, is) = (it.storage(), it.size());
            let targets = self.dense(&[n], is);
            let leaf = self.dense(&[n], is);
            let stats = self.dense(&[n, 2], 4);
            let acc = self.dense(&[2, n], 4);
            let picks = self.dense(&[2, n], 4);
            let lse = self.dense(&[n], 4);
            let out = self.dense(&[n, 2], 4);
            for ignore in [None, Some(-100)] {
                let r = tp::leaf_targets(self.client, &targets, &leaf, st, 64, 128, ignore);
                self.done(r, || format!("tp::leaf_targets {it:?} ignore {ignore:?}"));
                let global = GlobalTargets {
                    targets: &targets,
                    dtype: st,
                    vocab: 150,
                    ignore_index: ignore,
                };
                let r = tp::finish(self.client, &picks, &lse, &global, &out);
                self.done(r, || format!("tp::finish {it:?} ignore {ignore:?}"));
            }
            for with_acc in [false, true] {
                let r = tp::pick(
                    self.client,
                    with_acc.then_some(&acc),
                    &stats,
                    &leaf,
                    st,
                    &picks,
                );
                self.done(r, || format!("tp::pick {it:?} acc {with_acc}"));
            }
        }
        let (a, b, out) = (
            self.dense(&[n], 4),
            self.dense(&[n], 4),
            self.dense(&[n], 4),
        );
        let r = tp::merge_lse(self.client, &a, &b, &out);
        self.done(r, || "tp::merge_lse".into());
        let (a, b, out) = (
            self.dense(&[2, n], 4),
            self.dense(&[2, n], 4),
            self.dense(&[2, n], 4),
        );
        let r = tp::merge_entropy(self.client, &a, &b, &out);
        self.done(r, || "tp::merge_entropy".into());
    }

    // ---------------------------------------------------------------------------------------
    // Test helpers: fma_emulated_kernel, math_probe_kernel{emulate}.

    fn helpers(&mut self) {
        let x = [1.5f32, -0.75, 3.0];
        let r = fma_emulated_on_device(self.client, &x, &x, &x);
        self.done(r, || "fma_emulated_on_device".into());
        let r = attention_math_on_device(self.client, &x);
        self.done(r, || "attention_math_on_device".into());
    }
}

/// A sampler launch of the sweep: `linear_sample_forward` with `spec`, or with `lists`
/// `linear_top_k_forward` keeping `spec.k` (its seed and noise unused).
struct SampleCase {
    dt: FloatDType,
    d: usize,
    bias: bool,
    entropy: bool,
    keys: IndexDType,
    spec: SampleSpec,
    lists: bool,
}
