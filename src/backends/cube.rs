//! `InvariantBackend` for every `CubeBackend<R, F, I, BT>` (CUDA, wgpu, ROCm): the `CubeCl`
//! kernels of the `burn-invariant-cubecl` crate, and on CUDA the `Sm90` kernels
//! (`super::sm90`). Outputs and workspaces are allocated on the tensors' own client and
//! stream, so the ops order with every other Burn op.
use burn::tensor::{
    DType, Slice,
    ops::{FloatTensor, FloatTensorOps, IntTensor, IntTensorOps},
};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, kernel::into_contiguous,
    tensor::CubeTensor,
};
use burn_invariant_cubecl::{KernelError, attention, gemm, logp, rms_norm, tp as tp_kernels, util};

use super::alloc::{empty, zeros};
#[cfg(feature = "cuda")]
use super::sm90;
use crate::InvariantError;
use crate::backend::{GradRequest, InvariantBackend, LinearLogpGrads, LinearLogpInputs, Problem};
use crate::registry::{Candidate, Implementation, Op};

/// Whether the CubeCL kernels can run `dtype` on this device.
pub(crate) fn cubecl_candidate<R: CubeRuntime>(device: &R::Device, dtype: DType) -> Candidate {
    let client = R::client(device);
    let storage = match dtype {
        DType::F32 | DType::F16 | DType::BF16 => dtype.into(),
        other => {
            return Candidate::unavailable(
                Implementation::CubeCl,
                format!("the CubeCL kernels take F32, F16 or BF16, got {other:?}"),
            );
        }
    };
    if util::runtime_supports(&client, storage) {
        Candidate::available(Implementation::CubeCl)
    } else {
        Candidate::unavailable(
            Implementation::CubeCl,
            format!(
                "runtime `{}` does not support {dtype:?} on this device",
                R::name(&client)
            ),
        )
    }
}

/// Targets as the kernels take them: i32 or i64. Other integer dtypes are converted once, to
/// i64 where the runtime has it, so every value keeps its meaning (an unsigned value past
/// `i64::MAX` becomes negative: out of range, never another class). A runtime without i64 holds
/// no 64-bit targets, and an unsigned 32-bit value past `i32::MAX` turns negative: out of range.
fn index_targets<R: CubeRuntime>(targets: CubeTensor<R>) -> CubeTensor<R> {
    use burn::tensor::{IntDType, ops::IntTensorOps};
    if matches!(targets.dtype, DType::I32 | DType::I64) {
        return targets;
    }
    let wide = util::runtime_supports(&targets.client, DType::I64.into());
    let dtype = if wide { IntDType::I64 } else { IntDType::I32 };
    CubeBackend::<R, f32, i32, u8>::int_cast(targets, dtype)
}

/// Kernel launches only fail on inputs the public API has already rejected: dtypes and shapes
/// (`api`), sizes (`cubecl_limits` through `check_problem`), 32-bit addressing (`addressable`),
/// grids (the kernels split launches to the runtime's cube count). A failure here is a bug.
pub(crate) fn launched<T>(result: Result<T, KernelError>) -> T {
    result.unwrap_or_else(|err| panic!("burn-invariant: a validated launch was refused: {err}"))
}

/// The CubeCl limits of a problem on `device`, checked before anything runs: the `linear_logp`
/// backward's workspace and grids (a forward may be differentiated later, where no error can be
/// returned). Every other size runs, in as many launches as it needs.
fn cubecl_limits<R: CubeRuntime>(
    device: &R::Device,
    dtype: DType,
    problem: Problem,
) -> Result<(), InvariantError> {
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Ok(());
    }
    let client = R::client(device);
    let checked = match problem {
        Problem::Matmul { .. } => return Ok(()),
        Problem::LinearLogp { n, d, v } => {
            logp::linear_logp_limits(&client, [n, d, v], dtype.into(), true)
        }
        Problem::Attention {
            batch,
            heads,
            kv_heads,
            q_len,
            kv_len,
            head_dim,
        } => attention::attention_limits(
            &client,
            attention::AttentionDims {
                batch,
                heads,
                kv_heads,
                q_len,
                kv_len,
                head_dim,
            },
        ),
        Problem::RmsNorm { n, d } => rms_norm::rms_norm_limits(&client, n, d),
    };
    checked.map_err(|err| kernel_limit(err, problem))
}

/// A kernel's refusal of a problem as the caller's error.
pub(crate) fn kernel_limit(err: KernelError, problem: Problem) -> InvariantError {
    let too_large = |arg, what, got: u128, limit: u128| InvariantError::TooLarge {
        arg,
        what,
        got: got.min(u64::MAX as u128) as u64,
        limit: limit.min(u64::MAX as u128) as u64,
    };
    match err {
        KernelError::IndexOverflow {
            arg,
            what,
            value,
            limit,
        } => too_large(arg, what, value, limit),
        KernelError::GridTooLarge {
            arg,
            what,
            value,
            limit,
        } => too_large(arg, what, value.into(), limit.into()),
        other => InvariantError::UnsupportedProblem {
            implementation: Implementation::CubeCl,
            problem,
            reason: other.to_string(),
        },
    }
}

/// `t`, copied to a contiguous buffer where its buffer or the span its strides address passes
/// the kernels' 32-bit offsets (a column slice of a wide tensor); its own element count fits
/// (`api` checks it), so the copy does.
pub(crate) fn addressable<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    let limit = burn_invariant_cubecl::consts::MAX_INDEX;
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    let span = if shape.contains(&0) {
        0
    } else {
        shape
            .iter()
            .zip(strides.iter())
            .map(|(&s, &st)| (s as u128 - 1) * st as u128)
            .sum::<u128>()
    };
    let buffer = t.handle.size_in_used() as u128 / t.dtype.size() as u128;
    if span <= limit && buffer <= limit + 1 {
        t
    } else if t.is_contiguous() {
        // Contiguous, but in a larger buffer than its elements: a copy of just them.
        t.copy()
    } else {
        into_contiguous(t)
    }
}

fn is_empty(shape: &[usize]) -> bool {
    shape.contains(&0)
}

/// The candidates of an op with raw SM90 kernels: Sm90 first where it can run; otherwise it
/// stays listed after CubeCl so forcing it explains why not.
fn with_sm90<R: CubeRuntime>(
    cubecl: Candidate,
    device: &R::Device,
    dtype: DType,
) -> Vec<Candidate> {
    #[cfg(feature = "cuda")]
    let sm90 = sm90::candidate::<R>(device, dtype);
    #[cfg(not(feature = "cuda"))]
    let sm90 = {
        let _ = (device, dtype);
        Candidate::unavailable(
            Implementation::Sm90,
            "needs a CUDA device and the `cuda` feature of burn-invariant",
        )
    };
    if sm90.availability.is_ok() {
        vec![sm90, cubecl]
    } else {
        vec![cubecl, sm90]
    }
}

/// CubeCL `grad · rhsᵀ`: a transposed view (strides swapped, no copy), the kernels take any
/// strides.
fn matmul_grad_lhs<R: CubeRuntime>(grad: CubeTensor<R>, rhs: CubeTensor<R>) -> CubeTensor<R> {
    matmul(
        grad,
        CubeBackend::<R, f32, i32, u8>::float_swap_dims(rhs, 0, 1),
        None,
    )
}

/// CubeCL `lhsᵀ · grad`, rows reduced in ascending order.
fn matmul_grad_rhs<R: CubeRuntime>(lhs: CubeTensor<R>, grad: CubeTensor<R>) -> CubeTensor<R> {
    let (k, n) = (lhs.meta.shape()[1], grad.meta.shape()[1]);
    let m = lhs.meta.shape()[0];
    if is_empty(&[k, n]) || m == 0 {
        return zeros(&grad, vec![k, n], grad.dtype);
    }
    let out = empty(&grad, vec![k, n], grad.dtype);
    let (lhs, grad) = (addressable(lhs), addressable(grad));
    launched(gemm::matmul_row_reduction(
        &grad.client,
        &CubeBackend::<R, f32, i32, u8>::float_swap_dims(lhs, 0, 1).binding(),
        &grad.clone().binding(),
        &out.clone().binding(),
        grad.dtype.into(),
    ));
    out
}

/// CubeCL `matmul` with an optional bias.
pub(crate) fn matmul<R: CubeRuntime>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
) -> CubeTensor<R> {
    let (m, n) = (lhs.meta.shape()[0], rhs.meta.shape()[1]);
    let out = empty(&lhs, vec![m, n], lhs.dtype);
    if is_empty(&[m, n]) {
        return out;
    }
    let (lhs, rhs) = (addressable(lhs), addressable(rhs));
    let bias = bias.map(|b| addressable(b).binding());
    launched(gemm::matmul(
        &lhs.client,
        &lhs.clone().binding(),
        &rhs.binding(),
        bias.as_ref(),
        &out.clone().binding(),
        lhs.dtype.into(),
    ));
    out
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> InvariantBackend
    for CubeBackend<R, F, I, BT>
{
    fn implementations(op: Op, device: &Self::Device, dtype: DType) -> Vec<Candidate> {
        let cubecl = cubecl_candidate::<R>(device, dtype);
        match op {
            Op::Matmul | Op::LinearLogp => with_sm90::<R>(cubecl, device, dtype),
            // No raw SM90 kernels for these ops: Hopper runs the CubeCL ones.
            Op::Attention | Op::RmsNorm => vec![
                cubecl,
                Candidate::unavailable(
                    Implementation::Sm90,
                    format!("{op:?} has no Sm90 kernels; it runs on CubeCl on every CUDA device"),
                ),
            ],
        }
    }

    fn check_problem(
        implementation: Implementation,
        device: &Self::Device,
        dtype: DType,
        problem: Problem,
    ) -> Result<(), InvariantError> {
        match implementation {
            #[cfg(feature = "cuda")]
            Implementation::Sm90 => {
                sm90::check_problem(problem).map_err(|reason| InvariantError::UnsupportedProblem {
                    implementation,
                    problem,
                    reason,
                })
            }
            _ => cubecl_limits::<R>(device, dtype, problem),
        }
    }

    fn invariant_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        match implementation {
            #[cfg(feature = "cuda")]
            Implementation::Sm90
                if !is_empty(&[
                    lhs.meta.shape()[0],
                    lhs.meta.shape()[1],
                    rhs.meta.shape()[1],
                ]) =>
            {
                sm90::matmul(lhs, rhs, bias)
            }
            // An empty product is the bias or zeros whichever kernel runs (the Sm90 ones need
            // K ≥ 1). Reference is not offered here, nor Sm90 without the `cuda` feature: a
            // direct call with either runs the CubeCL kernels.
            Implementation::Sm90 | Implementation::CubeCl | Implementation::Reference => {
                matmul(lhs, rhs, bias)
            }
        }
    }

    fn invariant_matmul_grad_lhs(
        grad: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        match implementation {
            #[cfg(feature = "cuda")]
            Implementation::Sm90 => sm90::matmul_grad_lhs(grad, rhs),
            #[cfg(not(feature = "cuda"))]
            Implementation::Sm90 => matmul_grad_lhs(grad, rhs),
            // Reference is not offered here, nor Sm90 without the `cuda` feature: a direct call
            // with either runs the CubeCL kernels.
            Implementation::CubeCl | Implementation::Reference => matmul_grad_lhs(grad, rhs),
        }
    }

    fn invariant_matmul_grad_rhs(
        lhs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        match implementation {
            #[cfg(feature = "cuda")]
            Implementation::Sm90 => sm90::matmul_grad_rhs(lhs, grad),
            #[cfg(not(feature = "cuda"))]
            Implementation::Sm90 => matmul_grad_rhs(lhs, grad),
            // Reference is not offered here, nor Sm90 without the `cuda` feature: a direct call
            // with either runs the CubeCL kernels.
            Implementation::CubeCl | Implementation::Reference => matmul_grad_rhs(lhs, grad),
        }
    }

    fn invariant_sum_rows(
        grad: FloatTensor<Self>,
        _implementation: Implementation,
    ) -> FloatTensor<Self> {
        // One kernel for every implementation: Sm90 has no column sum of its own.
        let (m, n) = (grad.meta.shape()[0], grad.meta.shape()[1]);
        if m == 0 || n == 0 {
            return zeros(&grad, vec![n], grad.dtype);
        }
        let out = empty(&grad, vec![n], grad.dtype);
        let grad = addressable(grad);
        launched(gemm::col_sum(
            &grad.client,
            &grad.clone().binding(),
            &out.clone().binding(),
            grad.dtype.into(),
        ));
        out
    }

    fn invariant_linear_logp(
        inputs: LinearLogpInputs<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        match implementation {
            #[cfg(feature = "cuda")]
            Implementation::Sm90 => sm90::linear_logp(inputs),
            #[cfg(not(feature = "cuda"))]
            Implementation::Sm90 => linear_logp_forward(kernel_inputs(inputs)),
            // Reference is not offered here, nor Sm90 without the `cuda` feature: a direct call
            // with either runs the CubeCL kernels.
            Implementation::CubeCl | Implementation::Reference => {
                linear_logp_forward(kernel_inputs(inputs))
            }
        }
    }

    fn invariant_linear_logp_backward(
        inputs: LinearLogpInputs<Self>,
        stats: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        request: GradRequest,
        implementation: Implementation,
    ) -> LinearLogpGrads<Self> {
        match implementation {
            #[cfg(feature = "cuda")]
            Implementation::Sm90 => sm90::linear_logp_backward(inputs, stats, grad, request),
            #[cfg(not(feature = "cuda"))]
            Implementation::Sm90 => linear_logp_backward(inputs, stats, grad, request),
            // Reference is not offered here, nor Sm90 without the `cuda` feature: a direct call
            // with either runs the CubeCL kernels.
            Implementation::CubeCl | Implementation::Reference => {
                linear_logp_backward(inputs, stats, grad, request)
            }
        }
    }

    fn invariant_tp_leaf_targets(
        targets: IntTensor<Self>,
        start: usize,
        end: usize,
        ignore_index: Option<i64>,
    ) -> IntTensor<Self> {
        let targets = into_contiguous(index_targets(targets));
        let out = empty(&targets, targets.meta.shape().to_vec(), targets.dtype);
        launched(tp_kernels::leaf_targets(
            &targets.client,
            &targets.clone().binding(),
            &out.clone().binding(),
            targets.dtype.into(),
            start,
            end,
            ignore_index,
        ));
        out
    }

    fn invariant_tp_merge_lse(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        merge(a, b, tp_kernels::merge_lse)
    }

    fn invariant_tp_merge_entropy(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        merge(a, b, tp_kernels::merge_entropy)
    }

    fn invariant_tp_pick(
        acc: Option<FloatTensor<Self>>,
        stats: FloatTensor<Self>,
        leaf_targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let (stats, leaf_targets) = (
            into_contiguous(stats),
            into_contiguous(index_targets(leaf_targets)),
        );
        let acc = acc.map(into_contiguous);
        let n = leaf_targets.meta.shape()[0];
        let out = empty(&stats, vec![2, n], DType::F32);
        let acc_binding = acc.map(|a| a.binding());
        launched(tp_kernels::pick(
            &stats.client,
            acc_binding.as_ref(),
            &stats.clone().binding(),
            &leaf_targets.clone().binding(),
            leaf_targets.dtype.into(),
            &out.clone().binding(),
        ));
        out
    }

    fn invariant_tp_finish(
        picks: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        targets: IntTensor<Self>,
        vocab: usize,
        ignore_index: Option<i64>,
    ) -> FloatTensor<Self> {
        let (picks, lse, targets) = (
            into_contiguous(picks),
            into_contiguous(lse),
            into_contiguous(index_targets(targets)),
        );
        let n = targets.meta.shape()[0];
        let out = empty(&lse, vec![n, 2], DType::F32);
        let targets_binding = targets.clone().binding();
        let global = tp_kernels::GlobalTargets {
            targets: &targets_binding,
            dtype: targets.dtype.into(),
            vocab,
            ignore_index,
        };
        launched(tp_kernels::finish(
            &lse.client,
            &picks.binding(),
            &lse.clone().binding(),
            &global,
            &out.clone().binding(),
        ));
        out
    }
}

/// A tensor-parallel merge kernel's `out = a ⊕ b` over contiguous f32 operands of `a`'s shape.
fn merge<R: CubeRuntime>(
    a: CubeTensor<R>,
    b: CubeTensor<R>,
    launch: MergeLaunch<R>,
) -> CubeTensor<R> {
    let (a, b) = (into_contiguous(a), into_contiguous(b));
    let out = empty(&a, a.meta.shape().to_vec(), DType::F32);
    launched(launch(
        &a.client,
        &a.clone().binding(),
        &b.binding(),
        &out.clone().binding(),
    ));
    out
}

/// The signature of `tp_kernels::merge_lse` and `tp_kernels::merge_entropy`.
type MergeLaunch<R> = fn(
    &cubecl::prelude::ComputeClient<R>,
    &cubecl::prelude::TensorBinding<R>,
    &cubecl::prelude::TensorBinding<R>,
    &cubecl::prelude::TensorBinding<R>,
) -> Result<(), KernelError>;

/// The inputs as the kernels take them: targets in a kernel dtype, every view addressable.
fn kernel_inputs<R, F, I, BT>(
    inputs: LinearLogpInputs<CubeBackend<R, F, I, BT>>,
) -> LinearLogpInputs<CubeBackend<R, F, I, BT>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    LinearLogpInputs {
        hidden: addressable(inputs.hidden),
        weight: addressable(inputs.weight),
        bias: inputs.bias.map(addressable),
        targets: addressable(index_targets(inputs.targets)),
        ..inputs
    }
}

/// The CubeCl `linear_logp` forward, in calls of at most
/// [`logp::linear_logp_forward_max_rows`] rows (rows are independent: the split changes no bit),
/// all sharing one workspace on the stream.
fn linear_logp_forward<R, F, I, BT>(
    inputs: LinearLogpInputs<CubeBackend<R, F, I, BT>>,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    type B<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    let (n, v) = (inputs.hidden.meta.shape()[0], inputs.weight.meta.shape()[0]);
    let dtype = inputs.hidden.dtype.into();
    let columns = inputs.head.columns();
    if n == 0 {
        return empty(&inputs.hidden, vec![0, columns], DType::F32);
    }
    let rows = logp::linear_logp_forward_max_rows(&inputs.hidden.client, v, dtype).min(n);
    let workspace = empty(
        &inputs.hidden,
        vec![logp::linear_logp_forward_workspace_len(rows, v, dtype).max(1)],
        DType::F32,
    );
    let run = |inputs: &LinearLogpInputs<B<R, F, I, BT>>| {
        let rh = inputs.hidden.meta.shape()[0];
        let stats = empty(&inputs.hidden, vec![rh, columns], DType::F32);
        let bindings = LogpBindings::new(inputs);
        launched(logp::linear_logp_forward(
            &inputs.hidden.client,
            &bindings.refs(inputs),
            &stats.clone().binding(),
            &workspace.clone().binding(),
        ));
        stats
    };
    if rows == n {
        return run(&inputs);
    }
    let parts = (0..n)
        .step_by(rows)
        .map(|start| {
            let range = [Slice::from(start..n.min(start + rows))];
            let part = LinearLogpInputs {
                hidden: B::<R, F, I, BT>::float_slice(inputs.hidden.clone(), &range),
                targets: B::<R, F, I, BT>::int_slice(inputs.targets.clone(), &range),
                ..inputs.clone()
            };
            run(&part)
        })
        .collect::<Vec<_>>();
    B::<R, F, I, BT>::float_cat(parts, 0)
}

/// The CubeCl `linear_logp` backward: zeroed gradients (rows with zero upstream gradient add
/// nothing), one bounded f32 workspace.
fn linear_logp_backward<R, F, I, BT>(
    inputs: LinearLogpInputs<CubeBackend<R, F, I, BT>>,
    stats: CubeTensor<R>,
    grad: CubeTensor<R>,
    request: GradRequest,
) -> LinearLogpGrads<CubeBackend<R, F, I, BT>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let inputs = kernel_inputs(inputs);
    let hidden_shape = inputs.hidden.meta.shape().to_vec();
    let weight_shape = inputs.weight.meta.shape().to_vec();
    let (n, d, v) = (hidden_shape[0], hidden_shape[1], weight_shape[0]);
    let d_hidden = zeros(&inputs.hidden, hidden_shape, inputs.hidden.dtype);
    let d_weight = zeros(&inputs.weight, weight_shape, inputs.weight.dtype);
    let d_bias = inputs.bias.as_ref().map(|b| zeros(b, vec![v], b.dtype));
    if n > 0 {
        let workspace_len = launched(logp::linear_logp_backward_workspace_len(
            n,
            d,
            v,
            inputs.hidden.dtype.into(),
            inputs.bias.is_some(),
        ));
        let workspace = empty(&inputs.hidden, vec![workspace_len.max(1)], DType::F32);
        let bindings = LogpBindings::new(&inputs);
        let (dh, dw) = (d_hidden.clone().binding(), d_weight.clone().binding());
        let db = d_bias.clone().map(|b| b.binding());
        launched(logp::linear_logp_backward(
            &inputs.hidden.client,
            &bindings.refs(&inputs),
            &stats.binding(),
            &grad.binding(),
            &logp::LogpGradRefs {
                d_hidden: &dh,
                d_weight: &dw,
                d_bias: db.as_ref(),
            },
            &workspace.binding(),
        ));
    }
    LinearLogpGrads {
        hidden: request.hidden.then_some(d_hidden),
        weight: request.weight.then_some(d_weight),
        bias: d_bias.filter(|_| request.bias),
    }
}

/// Owned bindings of the `linear_logp` inputs (the kernel API borrows them).
struct LogpBindings<R: CubeRuntime> {
    hidden: cubecl::prelude::TensorBinding<R>,
    weight: cubecl::prelude::TensorBinding<R>,
    bias: Option<cubecl::prelude::TensorBinding<R>>,
    targets: cubecl::prelude::TensorBinding<R>,
}

impl<R: CubeRuntime> LogpBindings<R> {
    fn new<
        B: burn::tensor::backend::Backend<
                FloatTensorPrimitive = CubeTensor<R>,
                IntTensorPrimitive = CubeTensor<R>,
            >,
    >(
        inputs: &LinearLogpInputs<B>,
    ) -> Self {
        Self {
            hidden: inputs.hidden.clone().binding(),
            weight: inputs.weight.clone().binding(),
            bias: inputs.bias.clone().map(CubeTensor::binding),
            targets: inputs.targets.clone().binding(),
        }
    }

    fn refs<
        'a,
        B: burn::tensor::backend::Backend<
                FloatTensorPrimitive = CubeTensor<R>,
                IntTensorPrimitive = CubeTensor<R>,
            >,
    >(
        &'a self,
        inputs: &LinearLogpInputs<B>,
    ) -> logp::LogpInputRefs<'a, R> {
        logp::LogpInputRefs {
            hidden: &self.hidden,
            weight: &self.weight,
            bias: self.bias.as_ref(),
            targets: &self.targets,
            targets_dtype: inputs.targets.dtype.into(),
            ignore_index: inputs.ignore_index,
            dtype: inputs.hidden.dtype.into(),
            inv_temperature: inputs.head.inv_temperature,
            entropy: inputs.head.entropy,
        }
    }
}
