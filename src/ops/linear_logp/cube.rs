//! `linear_logp` on every `CubeBackend`: the kernels of `burn_invariant_cubecl::logp`, and on
//! CUDA the raw Sm90 ones (`crate::backends::sm90`); the one `match` between them per primitive.
use burn::tensor::{
    DType, Slice,
    ops::{FloatTensor, FloatTensorOps, IntTensorOps},
};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor,
};
use burn_invariant_cubecl::logp;

use super::{GradRequest, LinearLogpGrads, LinearLogpInputs, LinearLogpOps};
use crate::backends::alloc::{empty, zeros};
use crate::backends::cube::{
    NO_ROWS, ROWS_FIRST, addressable, index_targets, launch_class, launched, settle_launches,
};
#[cfg(feature = "cuda")]
use crate::backends::sm90;
use crate::registry::Implementation;

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> LinearLogpOps
    for CubeBackend<R, F, I, BT>
{
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
}

/// The inputs as the kernels take them: targets in a kernel dtype, every view addressable.
pub(crate) fn kernel_inputs<R, F, I, BT>(
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
    by_row_parts(inputs, rows, |inputs| {
        let rh = inputs.hidden.meta.shape()[0];
        let stats = empty(&inputs.hidden, vec![rh, columns], DType::F32);
        let bindings = LogpBindings::new(inputs);
        let class = logp_class("linear_logp", inputs);
        launched(logp::linear_logp_forward(
            &inputs.hidden.client,
            &bindings.refs(inputs),
            &stats.clone().binding(),
            &workspace.clone().binding(),
        ));
        settle_launches(&inputs.hidden.client, &inputs.hidden.device, class);
        stats
    })
}

/// `run` on row parts of at most `rows` rows (hidden and targets sliced alike), the results
/// concatenated: rows are independent, so the split changes no bit.
pub(crate) fn by_row_parts<R, F, I, BT>(
    inputs: LinearLogpInputs<CubeBackend<R, F, I, BT>>,
    rows: usize,
    run: impl Fn(&LinearLogpInputs<CubeBackend<R, F, I, BT>>) -> CubeTensor<R>,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    type B<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    let n = inputs.hidden.meta.shape()[0];
    if rows >= n {
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
        let class = logp_class("linear_logp_backward", &inputs);
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
        settle_launches(&inputs.hidden.client, &inputs.hidden.device, class);
    }
    LinearLogpGrads {
        hidden: request.hidden.then_some(d_hidden),
        weight: request.weight.then_some(d_weight),
        bias: d_bias.filter(|_| request.bias),
    }
}

/// The launch class of a `linear_logp` call: the rows vary freely; the head's switches, the
/// ignore index and the other sizes pick the kernels.
pub(crate) fn logp_class<R: CubeRuntime, B>(
    primitive: &'static str,
    inputs: &LinearLogpInputs<B>,
) -> u64
where
    B: burn::tensor::backend::Backend<
            FloatTensorPrimitive = CubeTensor<R>,
            IntTensorPrimitive = CubeTensor<R>,
        >,
{
    let switches = (
        primitive,
        inputs.head.inv_temperature.to_bits(),
        inputs.head.entropy,
        inputs.ignore_index.is_some(),
    );
    let mut operands: Vec<(&CubeTensor<R>, &[usize])> = vec![
        (&inputs.hidden, ROWS_FIRST),
        (&inputs.weight, NO_ROWS),
        (&inputs.targets, ROWS_FIRST),
    ];
    operands.extend(inputs.bias.as_ref().map(|b| (b, NO_ROWS)));
    launch_class(switches, &operands)
}

/// Owned bindings of the `linear_logp` inputs (the kernel API borrows them).
pub(crate) struct LogpBindings<R: CubeRuntime> {
    hidden: cubecl::prelude::TensorBinding<R>,
    weight: cubecl::prelude::TensorBinding<R>,
    bias: Option<cubecl::prelude::TensorBinding<R>>,
    targets: cubecl::prelude::TensorBinding<R>,
}

impl<R: CubeRuntime> LogpBindings<R> {
    pub(crate) fn new<
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

    pub(crate) fn refs<
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
