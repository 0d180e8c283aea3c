//! `InvariantBackend` for every `CubeBackend<R, F, I, BT>` (CUDA, wgpu, ROCm) and for the
//! `Fusion` wrapper the default `burn::backend::{Wgpu, Cuda}` types use. The kernels live in
//! the `burn-invariant-cubecl` crate; this module allocates outputs and workspaces on the
//! tensors' own client and stream, so the ops order with every other Burn op.
mod fusion;
#[cfg(feature = "cuda")]
mod sm90;
#[cfg(feature = "cuda")]
pub(crate) use sm90::launch_stream_sync;

use burn::tensor::{
    DType, Shape,
    ops::{FloatTensor, FloatTensorOps, IntTensor},
};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement,
    kernel::into_contiguous,
    ops::numeric::{empty_device_contiguous_dtype, zeros_client},
    tensor::CubeTensor,
};
use burn_invariant_cubecl as kernels;

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
    if kernels::util::runtime_supports(&client, storage) {
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

/// The `Sm90` candidate: CUDA, compute capability exactly 9.0 (`sm_90a` code runs nowhere
/// else), bf16 or f16.
fn sm90_candidate<R: CubeRuntime>(device: &R::Device, dtype: DType) -> Candidate {
    #[cfg(feature = "cuda")]
    if let Some(device) = (device as &dyn std::any::Any).downcast_ref::<cubecl::cuda::CudaDevice>()
    {
        return match (sm90::compute_capability(device), dtype) {
            (Some(90), DType::BF16 | DType::F16) => Candidate::available(Implementation::Sm90),
            (Some(90), other) => Candidate::unavailable(
                Implementation::Sm90,
                format!("the Sm90 kernels take BF16 or F16, got {other:?} (it runs on CubeCl)"),
            ),
            (Some(cc), _) => Candidate::unavailable(
                Implementation::Sm90,
                format!(
                    "needs compute capability 9.0, the device has {}.{}",
                    cc / 10,
                    cc % 10
                ),
            ),
            (None, _) => Candidate::unavailable(
                Implementation::Sm90,
                "the CUDA driver did not report a compute capability",
            ),
        };
    }
    let _ = (device, dtype);
    Candidate::unavailable(
        Implementation::Sm90,
        format!(
            "needs a CUDA device, this is {}",
            R::name(&R::client(device))
        ),
    )
}

/// Runs `f` on the tensors as CUDA tensors; the registry only selects `Sm90` on CUDA.
#[cfg(feature = "cuda")]
fn on_cuda<R: CubeRuntime, T, U>(t: T, f: impl FnOnce(T::Cuda) -> U::Cuda) -> U
where
    T: CudaCast<R>,
    U: CudaCast<R>,
{
    U::from_cuda(f(t.into_cuda()))
}

/// Moves CubeCL tensors (or bundles of them) between `R` and `CudaRuntime` when they are the
/// same type.
#[cfg(feature = "cuda")]
trait CudaCast<R: CubeRuntime>: Sized {
    type Cuda;
    fn into_cuda(self) -> Self::Cuda;
    fn from_cuda(cuda: Self::Cuda) -> Self;
}

#[cfg(feature = "cuda")]
fn downcast<A: 'static, B: 'static>(value: A) -> B {
    *(Box::new(value) as Box<dyn std::any::Any>)
        .downcast::<B>()
        .unwrap_or_else(|_| unreachable!("Sm90 selected on a non-CUDA runtime"))
}

#[cfg(feature = "cuda")]
impl<R: CubeRuntime> CudaCast<R> for CubeTensor<R> {
    type Cuda = CubeTensor<cubecl::cuda::CudaRuntime>;
    fn into_cuda(self) -> Self::Cuda {
        downcast(self)
    }
    fn from_cuda(cuda: Self::Cuda) -> Self {
        downcast(cuda)
    }
}

#[cfg(feature = "cuda")]
impl<R: CubeRuntime, A: CudaCast<R>, B: CudaCast<R>> CudaCast<R> for (A, B) {
    type Cuda = (A::Cuda, B::Cuda);
    fn into_cuda(self) -> Self::Cuda {
        (self.0.into_cuda(), self.1.into_cuda())
    }
    fn from_cuda(cuda: Self::Cuda) -> Self {
        (A::from_cuda(cuda.0), B::from_cuda(cuda.1))
    }
}

#[cfg(feature = "cuda")]
impl<R: CubeRuntime> CudaCast<R> for Option<CubeTensor<R>> {
    type Cuda = Option<CubeTensor<cubecl::cuda::CudaRuntime>>;
    fn into_cuda(self) -> Self::Cuda {
        self.map(downcast)
    }
    fn from_cuda(cuda: Self::Cuda) -> Self {
        cuda.map(downcast)
    }
}

fn empty<R: CubeRuntime>(like: &CubeTensor<R>, shape: Vec<usize>, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape),
        dtype,
    )
}

/// Zeros; an empty shape only allocates (a fill kernel over zero elements is an invalid launch
/// on CUDA).
fn zeros<R: CubeRuntime>(like: &CubeTensor<R>, shape: Vec<usize>, dtype: DType) -> CubeTensor<R> {
    if shape.contains(&0) {
        return empty(like, shape, dtype);
    }
    zeros_client(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape),
        dtype,
    )
}

/// Kernel launches only fail on inputs the public API has already rejected.
fn launched<T>(result: Result<T, kernels::KernelError>) -> T {
    result.unwrap_or_else(|err| panic!("burn-invariant: a validated launch was refused: {err}"))
}

fn is_empty(shape: &[usize]) -> bool {
    shape.contains(&0)
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
    let bias = bias.map(|b| b.binding());
    launched(kernels::gemm::matmul(
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
    fn implementations(_op: Op, device: &Self::Device, dtype: DType) -> Vec<Candidate> {
        let (sm90, cubecl) = (
            sm90_candidate::<R>(device, dtype),
            cubecl_candidate::<R>(device, dtype),
        );
        // Sm90 first where it can run; otherwise it stays listed so forcing it explains why not.
        if sm90.availability.is_ok() {
            vec![sm90, cubecl]
        } else {
            vec![cubecl, sm90]
        }
    }

    fn check_problem(implementation: Implementation, problem: Problem) -> Result<(), String> {
        const SM90_LIMIT: usize = (1 << 31) - 257;
        match (implementation, problem) {
            (Implementation::Sm90, Problem::LinearLogp { d: 0, .. }) => {
                Err("the Sm90 linear_logp kernels need a hidden size D >= 1".into())
            }
            (
                Implementation::Sm90,
                Problem::Matmul { m, k, n } | Problem::LinearLogp { n: m, d: k, v: n },
            ) if m.max(k).max(n) > SM90_LIMIT => Err(format!(
                "the Sm90 kernels take dimensions up to {SM90_LIMIT}"
            )),
            _ => Ok(()),
        }
    }

    fn invariant_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if implementation == Implementation::Sm90 {
            return on_cuda::<R, _, CubeTensor<R>>((lhs, (rhs, bias)), |(l, (r, b))| {
                sm90::matmul(l, r, b)
            });
        }
        let _ = implementation;
        matmul(lhs, rhs, bias)
    }

    fn invariant_matmul_grad_lhs(
        grad: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if implementation == Implementation::Sm90 {
            return on_cuda::<R, _, CubeTensor<R>>((grad, rhs), |(g, r)| {
                sm90::matmul_grad_lhs(g, r)
            });
        }
        let _ = implementation;
        // A transposed view (strides swapped, no copy): the kernels take any strides.
        matmul(grad, Self::float_swap_dims(rhs, 0, 1), None)
    }

    fn invariant_matmul_grad_rhs(
        lhs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if implementation == Implementation::Sm90 {
            return on_cuda::<R, _, CubeTensor<R>>((lhs, grad), |(l, g)| {
                sm90::matmul_grad_rhs(l, g)
            });
        }
        let _ = implementation;
        let (k, n) = (lhs.meta.shape()[1], grad.meta.shape()[1]);
        let m = lhs.meta.shape()[0];
        if is_empty(&[k, n]) || m == 0 {
            return zeros(&grad, vec![k, n], grad.dtype);
        }
        let out = empty(&grad, vec![k, n], grad.dtype);
        launched(kernels::gemm::matmul_row_reduction(
            &grad.client,
            &Self::float_swap_dims(lhs, 0, 1).binding(),
            &grad.clone().binding(),
            &out.clone().binding(),
            grad.dtype.into(),
        ));
        out
    }

    fn invariant_sum_rows(
        grad: FloatTensor<Self>,
        _implementation: Implementation,
    ) -> FloatTensor<Self> {
        let (m, n) = (grad.meta.shape()[0], grad.meta.shape()[1]);
        if m == 0 || n == 0 {
            return zeros(&grad, vec![n], grad.dtype);
        }
        let out = empty(&grad, vec![n], grad.dtype);
        launched(kernels::gemm::col_sum(
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
        #[cfg(feature = "cuda")]
        if implementation == Implementation::Sm90 {
            let ignore_index = inputs.ignore_index;
            let args = (
                inputs.hidden,
                (inputs.weight, (inputs.bias, inputs.targets)),
            );
            return on_cuda::<R, _, CubeTensor<R>>(args, |(h, (w, (b, t)))| {
                sm90::linear_logp(h, w, b, t, ignore_index)
            });
        }
        let _ = implementation;
        let (n, v) = (inputs.hidden.meta.shape()[0], inputs.weight.meta.shape()[0]);
        let stats = empty(&inputs.hidden, vec![n, 2], DType::F32);
        if n == 0 {
            return stats;
        }
        let workspace = empty(
            &inputs.hidden,
            vec![kernels::logp::linear_logp_forward_workspace_len(n, v).max(1)],
            DType::F32,
        );
        let bindings = LogpBindings::new(&inputs);
        launched(kernels::logp::linear_logp_forward(
            &inputs.hidden.client,
            &bindings.inputs(&inputs),
            &stats.clone().binding(),
            &workspace.binding(),
        ));
        stats
    }

    fn invariant_linear_logp_backward(
        inputs: LinearLogpInputs<Self>,
        stats: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        request: GradRequest,
        implementation: Implementation,
    ) -> LinearLogpGrads<Self> {
        #[cfg(feature = "cuda")]
        if implementation == Implementation::Sm90 {
            let ignore_index = inputs.ignore_index;
            let args = (
                inputs.hidden,
                (
                    inputs.weight,
                    (inputs.bias, (inputs.targets, (stats, grad))),
                ),
            );
            let (d_hidden, (d_weight, d_bias)) =
                on_cuda::<R, _, (CubeTensor<R>, (CubeTensor<R>, Option<CubeTensor<R>>))>(
                    args,
                    |(h, (w, (b, (t, (s, g)))))| {
                        let (dh, dw, db) =
                            sm90::linear_logp_backward(h, w, b, t, ignore_index, s, g);
                        (dh, (dw, db))
                    },
                );
            return LinearLogpGrads {
                hidden: request.hidden.then_some(d_hidden),
                weight: request.weight.then_some(d_weight),
                bias: d_bias.filter(|_| request.bias),
            };
        }
        let _ = implementation;
        let hidden_shape = inputs.hidden.meta.shape().to_vec();
        let weight_shape = inputs.weight.meta.shape().to_vec();
        let (n, d, v) = (hidden_shape[0], hidden_shape[1], weight_shape[0]);
        let d_hidden = zeros(&inputs.hidden, hidden_shape, inputs.hidden.dtype);
        let d_weight = zeros(&inputs.weight, weight_shape, inputs.weight.dtype);
        let d_bias = inputs.bias.as_ref().map(|b| zeros(b, vec![v], b.dtype));
        if n > 0 {
            let workspace_len = launched(kernels::logp::linear_logp_backward_workspace_len(
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
            launched(kernels::logp::linear_logp_backward(
                &inputs.hidden.client,
                &bindings.inputs(&inputs),
                &stats.binding(),
                &grad.binding(),
                &kernels::logp::LinearLogpGrads {
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

    fn invariant_tp_leaf_targets(
        targets: IntTensor<Self>,
        start: usize,
        end: usize,
        ignore_index: Option<i64>,
    ) -> IntTensor<Self> {
        let targets = into_contiguous(targets);
        let out = empty(&targets, targets.meta.shape().to_vec(), targets.dtype);
        launched(kernels::tp::leaf_targets(
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
        let (a, b) = (into_contiguous(a), into_contiguous(b));
        let out = empty(&a, a.meta.shape().to_vec(), DType::F32);
        launched(kernels::tp::merge_lse(
            &a.client,
            &a.clone().binding(),
            &b.binding(),
            &out.clone().binding(),
        ));
        out
    }

    fn invariant_tp_pick(
        acc: Option<FloatTensor<Self>>,
        stats: FloatTensor<Self>,
        leaf_targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let (stats, leaf_targets) = (into_contiguous(stats), into_contiguous(leaf_targets));
        let acc = acc.map(into_contiguous);
        let n = leaf_targets.meta.shape()[0];
        let out = empty(&stats, vec![2, n], DType::F32);
        let acc_binding = acc.map(|a| a.binding());
        launched(kernels::tp::pick(
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
            into_contiguous(targets),
        );
        let n = targets.meta.shape()[0];
        let out = empty(&lse, vec![n, 2], DType::F32);
        launched(kernels::tp::finish(
            &lse.client,
            &picks.binding(),
            &lse.clone().binding(),
            &targets.clone().binding(),
            targets.dtype.into(),
            vocab,
            ignore_index,
            &out.clone().binding(),
        ));
        out
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

    fn inputs<
        'a,
        B: burn::tensor::backend::Backend<
                FloatTensorPrimitive = CubeTensor<R>,
                IntTensorPrimitive = CubeTensor<R>,
            >,
    >(
        &'a self,
        inputs: &LinearLogpInputs<B>,
    ) -> kernels::logp::LinearLogpInputs<'a, R> {
        kernels::logp::LinearLogpInputs {
            hidden: &self.hidden,
            weight: &self.weight,
            bias: self.bias.as_ref(),
            targets: &self.targets,
            targets_dtype: inputs.targets.dtype.into(),
            ignore_index: inputs.ignore_index,
            dtype: inputs.hidden.dtype.into(),
        }
    }
}
