//! `linear_sample` on every `CubeBackend`: `burn_invariant_cubecl::logp::linear_sample_forward`;
//! on CUDA where the registry chose Sm90, the Sm90 pass for Gumbel-max and greedy, and for top-k
//! (k > 1) the CubeCl kernels' tokens scored by the Sm90 `linear_logp`, so that `logp`, `lse`
//! and `entropy` are always the Sm90 bits the trainer gets.
use burn::tensor::{
    DType, Slice,
    ops::{FloatTensor, FloatTensorOps},
};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor,
};
use burn_invariant_cubecl::logp::{self, SampleSpec};
use burn_invariant_cubecl::{KernelError, LogpInputRefs};
use cubecl::prelude::{ComputeClient, TensorBinding};

use super::{LinearSampleInputs, LinearSampleOps, SampleRule, Sampler};
use crate::backends::alloc::empty;
use crate::backends::cube::{launched, settle_launches};
#[cfg(feature = "cuda")]
use crate::backends::sm90;
use crate::ops::linear_logp::LinearLogpInputs;
use crate::ops::linear_logp::cube::{LogpBindings, by_row_parts, kernel_inputs, logp_class};
use crate::registry::Implementation;

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> LinearSampleOps
    for CubeBackend<R, F, I, BT>
{
    fn invariant_linear_sample(
        inputs: LinearSampleInputs<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let (logits, sampler) = inputs.logits();
        match implementation {
            #[cfg(feature = "cuda")]
            Implementation::Sm90 => match sampler.rule {
                SampleRule::Gumbel => sm90::linear_sample(logits, sampler.seed, true),
                SampleRule::Greedy | SampleRule::TopK(1) => {
                    sm90::linear_sample(logits, sampler.seed, false)
                }
                SampleRule::TopK(_) => sm90_scored(logits, sampler),
            },
            // Reference is not offered here, nor Sm90 without the `cuda` feature: a direct call
            // with either runs the CubeCL kernels.
            _ => sample_forward(logits, sampler),
        }
    }

    fn invariant_linear_top_k(
        inputs: LinearLogpInputs<Self>,
        k: usize,
        _implementation: Implementation,
    ) -> FloatTensor<Self> {
        // Every implementation takes the CubeCL kernels' lists (Sm90's pass keeps one candidate
        // per segment and returns no logit).
        top_k_forward(inputs, k as u32)
    }
}

/// The kernels' draw.
fn spec(sampler: Sampler) -> SampleSpec {
    let (k, noise) = match sampler.rule {
        SampleRule::Gumbel => (1, true),
        SampleRule::Greedy | SampleRule::TopK(1) => (1, false),
        SampleRule::TopK(k) => (k as u32, true),
    };
    SampleSpec {
        seed: sampler.seed,
        k,
        noise,
    }
}

/// The CubeCl sampler: `[N, C + 1]`.
fn sample_forward<R, F, I, BT>(
    inputs: LinearLogpInputs<CubeBackend<R, F, I, BT>>,
    sampler: Sampler,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let spec = spec(sampler);
    let columns = inputs.head.columns() + 1;
    in_parts(
        inputs,
        spec.k,
        columns,
        "linear_sample",
        |client, refs, out, ws| logp::linear_sample_forward(client, refs, spec, out, ws),
    )
}

/// The CubeCl top-k lists: `[N, 2k]`.
fn top_k_forward<R, F, I, BT>(
    inputs: LinearLogpInputs<CubeBackend<R, F, I, BT>>,
    k: u32,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let columns = 2 * k as usize;
    in_parts(
        inputs,
        k,
        columns,
        "linear_top_k",
        |client, refs, out, ws| logp::linear_top_k_forward(client, refs, k, out, ws),
    )
}

/// `launch` of a sampler kernel keeping `k` candidates into `[N, columns]`, in calls of at most
/// [`logp::linear_sample_max_rows`] rows sharing one workspace.
fn in_parts<R, F, I, BT>(
    inputs: LinearLogpInputs<CubeBackend<R, F, I, BT>>,
    k: u32,
    columns: usize,
    primitive: &'static str,
    launch: impl Fn(
        &ComputeClient<R>,
        &LogpInputRefs<'_, R>,
        &TensorBinding<R>,
        &TensorBinding<R>,
    ) -> Result<(), KernelError>,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let inputs = kernel_inputs(inputs);
    let (n, v) = (inputs.hidden.meta.shape()[0], inputs.weight.meta.shape()[0]);
    let dtype = inputs.hidden.dtype.into();
    let client = inputs.hidden.client.clone();
    let rows = logp::linear_sample_max_rows(&client, v, dtype, k).min(n);
    let workspace = empty(
        &inputs.hidden,
        vec![logp::linear_sample_workspace_len(rows, v, dtype, k).max(1)],
        DType::F32,
    );
    by_row_parts(inputs, rows, |inputs| {
        let rh = inputs.hidden.meta.shape()[0];
        let out = empty(&inputs.hidden, vec![rh, columns], DType::F32);
        let bindings = LogpBindings::new(inputs);
        let class = logp_class(primitive, inputs);
        launched(launch(
            &inputs.hidden.client,
            &bindings.refs(inputs),
            &out.clone().binding(),
            &workspace.clone().binding(),
        ));
        settle_launches(&inputs.hidden.client, &inputs.hidden.device, class);
        out
    })
}

/// Sm90 top-k: the CubeCl kernels' tokens (one kept list per row needs more registers than the
/// Sm90 pass has), then the Sm90 `linear_logp` with them as targets: a second GEMM.
#[cfg(feature = "cuda")]
fn sm90_scored<R, F, I, BT>(
    inputs: LinearLogpInputs<CubeBackend<R, F, I, BT>>,
    sampler: Sampler,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    use burn::tensor::{IntDType, ops::IntTensorOps};
    type B<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    let n = inputs.hidden.meta.shape()[0];
    let c = inputs.head.columns();
    let drawn = sample_forward(inputs.clone(), sampler);
    let token = B::<R, F, I, BT>::float_slice(drawn, &[Slice::from(0..n), Slice::from(c..c + 1)]);
    let flat = B::<R, F, I, BT>::float_reshape(token.clone(), [n].into());
    let targets = B::<R, F, I, BT>::float_into_int(flat, IntDType::I32);
    let targets = B::<R, F, I, BT>::int_reshape(targets, [n].into());
    let stats = sm90::linear_logp(LinearLogpInputs {
        targets,
        ignore_index: None,
        ..inputs
    });
    B::<R, F, I, BT>::float_cat(vec![stats, token], 1)
}
