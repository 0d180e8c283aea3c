//! One Fusion custom op with typed inputs: `F` float and `I` int tensors in, `O` float
//! tensors out, run by a closure on the inner backend. Fusion flushes around it, as
//! burn-vision does for its ops.
use std::marker::PhantomData;

use burn::tensor::{
    DType, Shape,
    ops::{FloatTensor, IntTensor},
};
use burn_fusion::{
    FusionBackend, FusionRuntime, FusionTensor,
    stream::{Operation, OperationStreams},
};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

/// What a custom op runs on the inner backend.
pub(crate) type Run<B, const F: usize, const I: usize, const O: usize> =
    Box<dyn Fn([FloatTensor<B>; F], [IntTensor<B>; I]) -> [FloatTensor<B>; O] + Send + Sync>;

/// [`Run`] for inputs and outputs counted at run time (an optional bias, requested gradients).
pub(crate) type RunVec<B> =
    Box<dyn Fn(Vec<FloatTensor<B>>, Vec<IntTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync>;

struct CustomOp<B: FusionBackend> {
    desc: CustomOpIr,
    /// The first `floats` inputs are float tensors, the others int tensors.
    floats: usize,
    run: RunVec<B>,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend> core::fmt::Debug for CustomOp<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CustomOp")
            .field("desc", &self.desc)
            .finish()
    }
}

impl<B: FusionBackend> Operation<B::FusionRuntime> for CustomOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let (floats, ints) = self.desc.inputs.split_at(self.floats);
        let floats = floats
            .iter()
            .map(|t| handles.get_float_tensor::<B>(t))
            .collect();
        let ints = ints
            .iter()
            .map(|t| handles.get_int_tensor::<B>(t))
            .collect();
        let results = (self.run)(floats, ints);
        for (out, tensor) in self.desc.outputs.iter().zip(results) {
            handles.register_float_tensor::<B>(&out.id, tensor);
        }
    }
}

/// Registers `run` as the custom op `name` over `floats` and `ints`, with outputs of these
/// shapes and dtypes.
pub(crate) fn custom_op<B: FusionBackend, const F: usize, const I: usize, const O: usize>(
    name: &'static str,
    floats: [FusionTensor<B::FusionRuntime>; F],
    ints: [FusionTensor<B::FusionRuntime>; I],
    outputs: [(Shape, DType); O],
    run: Run<B, F, I, O>,
) -> [FusionTensor<B::FusionRuntime>; O] {
    let run: RunVec<B> = Box::new(
        move |floats: Vec<FloatTensor<B>>, ints: Vec<IntTensor<B>>| {
            let floats = floats
                .try_into()
                .unwrap_or_else(|_| unreachable!("the {F} float inputs registered"));
            let ints = ints
                .try_into()
                .unwrap_or_else(|_| unreachable!("the {I} int inputs registered"));
            Vec::from(run(floats, ints))
        },
    );
    custom_op_vec::<B>(name, floats.into(), ints.into(), outputs.into(), run)
        .try_into()
        .unwrap_or_else(|_| unreachable!("one tensor per output asked for"))
}

/// [`custom_op`] with inputs and outputs counted at run time.
pub(crate) fn custom_op_vec<B: FusionBackend>(
    name: &'static str,
    floats: Vec<FusionTensor<B::FusionRuntime>>,
    ints: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: Vec<(Shape, DType)>,
    run: RunVec<B>,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    let client = floats
        .first()
        .map(|t| t.client.clone())
        .unwrap_or_else(|| unreachable!("every custom op has a float input"));
    let float_count = floats.len();
    let all: Vec<_> = floats.into_iter().chain(ints).collect();
    let streams = OperationStreams::with_inputs(all.iter());
    let outputs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype))
        .collect();
    let inputs: Vec<TensorIr> = all.into_iter().map(FusionTensor::into_ir).collect();
    let desc = CustomOpIr::new(name, &inputs, &outputs);
    client.register(
        streams,
        OperationIr::Custom(desc.clone()),
        CustomOp::<B> {
            desc,
            floats: float_count,
            run,
            _backend: PhantomData,
        },
    )
}
