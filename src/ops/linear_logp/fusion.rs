//! `linear_logp` under `Fusion`: opaque custom ops over the inner backend's primitives. Floats
//! in: hidden, weight[, bias][, stats, grad]; ints in: targets.
use burn::tensor::{
    DType, Shape,
    backend::Backend,
    ops::{FloatTensor, IntTensor},
};
use burn_fusion::{Fusion, FusionBackend};

use super::{GradRequest, LinearLogpGrads, LinearLogpInputs, LinearLogpOps, LogpHead};
use crate::backends::custom_op::{RunVec, custom_op_vec};
use crate::registry::Implementation;

/// An input the op was registered with.
fn registered<T>() -> T {
    unreachable!("the inputs registered with the op")
}

/// The arguments of a `linear_logp` primitive beside its tensors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Head {
    bias: bool,
    ignore_index: Option<i64>,
    head: LogpHead,
}

impl Head {
    /// The inner inputs from a custom op's tensors, and the floats after them.
    pub(crate) fn inputs<B: Backend>(
        self,
        floats: Vec<FloatTensor<B>>,
        ints: Vec<IntTensor<B>>,
    ) -> (LinearLogpInputs<B>, impl Iterator<Item = FloatTensor<B>>) {
        let mut floats = floats.into_iter();
        let (hidden, weight) = (floats.next(), floats.next());
        let bias = if self.bias { floats.next() } else { None };
        let inputs = LinearLogpInputs {
            hidden: hidden.unwrap_or_else(registered),
            weight: weight.unwrap_or_else(registered),
            bias,
            targets: ints.into_iter().next().unwrap_or_else(registered),
            ignore_index: self.ignore_index,
            head: self.head,
        };
        (inputs, floats)
    }
}

/// The custom op's floats and ints, and the arguments beside them.
pub(crate) type Split<B> = (Vec<FloatTensor<Fusion<B>>>, Vec<IntTensor<Fusion<B>>>, Head);

pub(crate) fn split<B: FusionBackend>(inputs: LinearLogpInputs<Fusion<B>>) -> Split<B> {
    let head = Head {
        bias: inputs.bias.is_some(),
        ignore_index: inputs.ignore_index,
        head: inputs.head,
    };
    let floats = [Some(inputs.hidden), Some(inputs.weight), inputs.bias]
        .into_iter()
        .flatten()
        .collect();
    (floats, vec![inputs.targets], head)
}

impl<B: FusionBackend + LinearLogpOps> LinearLogpOps for Fusion<B> {
    fn invariant_linear_logp(
        inputs: LinearLogpInputs<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let out = (
            Shape::from(vec![inputs.hidden.shape.to_vec()[0], inputs.head.columns()]),
            DType::F32,
        );
        let (floats, ints, head) = split::<B>(inputs);
        let run: RunVec<B> = Box::new(move |floats, ints| {
            let (inputs, _) = head.inputs::<B>(floats, ints);
            vec![B::invariant_linear_logp(inputs, implementation)]
        });
        custom_op_vec::<B>("burn_invariant::linear_logp", floats, ints, vec![out], run)
            .into_iter()
            .next()
            .unwrap_or_else(|| unreachable!("one output"))
    }

    fn invariant_linear_logp_backward(
        inputs: LinearLogpInputs<Self>,
        stats: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        request: GradRequest,
        implementation: Implementation,
    ) -> LinearLogpGrads<Self> {
        let request = GradRequest {
            bias: request.bias && inputs.bias.is_some(),
            ..request
        };
        let mut outputs = Vec::new();
        if request.hidden {
            outputs.push((inputs.hidden.shape.clone(), inputs.hidden.dtype));
        }
        if request.weight {
            outputs.push((inputs.weight.shape.clone(), inputs.weight.dtype));
        }
        if let Some(bias) = inputs.bias.as_ref().filter(|_| request.bias) {
            outputs.push((bias.shape.clone(), bias.dtype));
        }
        let (mut floats, ints, head) = split::<B>(inputs);
        floats.extend([stats, grad]);
        let run: RunVec<B> = Box::new(move |floats, ints| {
            let (inputs, mut rest) = head.inputs::<B>(floats, ints);
            let stats = rest.next().unwrap_or_else(registered);
            let grad = rest.next().unwrap_or_else(registered);
            let grads =
                B::invariant_linear_logp_backward(inputs, stats, grad, request, implementation);
            [grads.hidden, grads.weight, grads.bias]
                .into_iter()
                .flatten()
                .collect()
        });
        let mut results = custom_op_vec::<B>(
            "burn_invariant::linear_logp_backward",
            floats,
            ints,
            outputs,
            run,
        )
        .into_iter();
        // `outputs` was built from the same `request` (one per requested gradient, in this
        // order), and the op returns one tensor per output: the `expect`s cannot fire.
        LinearLogpGrads {
            hidden: request.hidden.then(|| results.next().expect("dHidden")),
            weight: request.weight.then(|| results.next().expect("dWeight")),
            bias: request.bias.then(|| results.next().expect("dBias")),
        }
    }
}
