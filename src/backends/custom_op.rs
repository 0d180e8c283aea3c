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

struct CustomOp<B: FusionBackend, const F: usize, const I: usize, const O: usize> {
    desc: CustomOpIr,
    run: Run<B, F, I, O>,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend, const F: usize, const I: usize, const O: usize> core::fmt::Debug
    for CustomOp<B, F, I, O>
{
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CustomOp")
            .field("desc", &self.desc)
            .finish()
    }
}

impl<B: FusionBackend, const F: usize, const I: usize, const O: usize> Operation<B::FusionRuntime>
    for CustomOp<B, F, I, O>
{
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let inputs = &self.desc.inputs;
        let floats = std::array::from_fn(|i| handles.get_float_tensor::<B>(&inputs[i]));
        let ints = std::array::from_fn(|i| handles.get_int_tensor::<B>(&inputs[F + i]));
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
    let client = floats
        .first()
        .map(|t| t.client.clone())
        .unwrap_or_else(|| unreachable!("every custom op has a float input"));
    let all: Vec<_> = floats.into_iter().chain(ints).collect();
    let streams = OperationStreams::with_inputs(all.iter());
    let outputs =
        outputs.map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype));
    let inputs: Vec<TensorIr> = all.into_iter().map(FusionTensor::into_ir).collect();
    let desc = CustomOpIr::new(name, &inputs, &outputs);
    let registered = client.register(
        streams,
        OperationIr::Custom(desc.clone()),
        CustomOp::<B, F, I, O> {
            desc,
            run,
            _backend: PhantomData,
        },
    );
    registered
        .try_into()
        .unwrap_or_else(|_| unreachable!("one tensor per output asked for"))
}
