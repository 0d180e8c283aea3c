//! `InvariantBackend` for `burn_fusion::Fusion<B>` (what `burn::backend::{Wgpu, Cuda}` are with
//! their default `fusion` feature). Each primitive is an opaque custom op: fusion flushes
//! around it and runs the inner backend's primitive, as burn-vision does.
use std::marker::PhantomData;

use burn::tensor::{DType, Shape, ops::FloatTensor};
use burn_fusion::{
    Fusion, FusionBackend, FusionRuntime, FusionTensor,
    stream::{Operation, OperationStreams},
};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use crate::InvariantError;
use crate::backend::{
    GradRequest, InvariantBackend, LinearLogpGrads, LinearLogpInputs, LogpHead, Problem,
};
use crate::registry::{Candidate, Implementation, Op};

/// Which primitive a custom op runs, with its non-tensor arguments.
#[derive(Debug, Clone, Copy)]
enum Primitive {
    Matmul {
        bias: bool,
    },
    MatmulGradLhs,
    MatmulGradRhs,
    SumRows,
    LinearLogp {
        bias: bool,
        ignore_index: Option<i64>,
        head: LogpHead,
    },
    LinearLogpBackward {
        bias: bool,
        ignore_index: Option<i64>,
        head: LogpHead,
        request: GradRequest,
    },
}

#[derive(Debug)]
struct InvariantOp<B: FusionBackend> {
    desc: CustomOpIr,
    primitive: Primitive,
    implementation: Implementation,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + InvariantBackend> Operation<B::FusionRuntime> for InvariantOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let inputs = &self.desc.inputs;
        let outputs = &self.desc.outputs;
        let float =
            |handles: &mut HandleContainer<_>, i: usize| handles.get_float_tensor::<B>(&inputs[i]);
        let imp = self.implementation;
        let logp_inputs = |handles: &mut HandleContainer<_>, bias: bool, ignore_index, head| {
            // Inputs: hidden, weight, [bias], targets, ...
            let targets_at = if bias { 3 } else { 2 };
            LinearLogpInputs::<B> {
                hidden: float(handles, 0),
                weight: float(handles, 1),
                bias: bias.then(|| float(handles, 2)),
                targets: handles.get_int_tensor::<B>(&inputs[targets_at]),
                ignore_index,
                head,
            }
        };
        let results: Vec<FloatTensor<B>> = match self.primitive {
            Primitive::Matmul { bias } => {
                let (lhs, rhs) = (float(handles, 0), float(handles, 1));
                let bias = bias.then(|| float(handles, 2));
                vec![B::invariant_matmul(lhs, rhs, bias, imp)]
            }
            Primitive::MatmulGradLhs => vec![B::invariant_matmul_grad_lhs(
                float(handles, 0),
                float(handles, 1),
                imp,
            )],
            Primitive::MatmulGradRhs => vec![B::invariant_matmul_grad_rhs(
                float(handles, 0),
                float(handles, 1),
                imp,
            )],
            Primitive::SumRows => vec![B::invariant_sum_rows(float(handles, 0), imp)],
            Primitive::LinearLogp {
                bias,
                ignore_index,
                head,
            } => {
                vec![B::invariant_linear_logp(
                    logp_inputs(handles, bias, ignore_index, head),
                    imp,
                )]
            }
            Primitive::LinearLogpBackward {
                bias,
                ignore_index,
                head,
                request,
            } => {
                let targets_at = if bias { 3 } else { 2 };
                let logp = logp_inputs(handles, bias, ignore_index, head);
                let stats = float(handles, targets_at + 1);
                let grad = float(handles, targets_at + 2);
                let grads = B::invariant_linear_logp_backward(logp, stats, grad, request, imp);
                [grads.hidden, grads.weight, grads.bias]
                    .into_iter()
                    .flatten()
                    .collect()
            }
        };
        for (out, tensor) in outputs.iter().zip(results) {
            handles.register_float_tensor::<B>(&out.id, tensor);
        }
    }
}

/// Registers one custom op and returns its outputs.
fn register<B: FusionBackend + InvariantBackend>(
    name: &'static str,
    primitive: Primitive,
    implementation: Implementation,
    floats: Vec<FusionTensor<B::FusionRuntime>>,
    targets: Option<FusionTensor<B::FusionRuntime>>,
    trailing: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: Vec<(Shape, DType)>,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    let client = floats[0].client.clone();
    let all: Vec<_> = floats.into_iter().chain(targets).chain(trailing).collect();
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
        InvariantOp::<B> {
            desc,
            primitive,
            implementation,
            _backend: PhantomData,
        },
    )
}

/// [`register`] of an op with one output.
fn register_one<B: FusionBackend + InvariantBackend>(
    name: &'static str,
    primitive: Primitive,
    implementation: Implementation,
    floats: Vec<FusionTensor<B::FusionRuntime>>,
    targets: Option<FusionTensor<B::FusionRuntime>>,
    trailing: Vec<FusionTensor<B::FusionRuntime>>,
    output: (Shape, DType),
) -> FusionTensor<B::FusionRuntime> {
    let outputs = register::<B>(
        name,
        primitive,
        implementation,
        floats,
        targets,
        trailing,
        vec![output],
    );
    // `register` returns one tensor per output asked for.
    outputs
        .into_iter()
        .next()
        .unwrap_or_else(|| unreachable!("one output"))
}

fn shape_of<R: FusionRuntime>(t: &FusionTensor<R>) -> Vec<usize> {
    t.shape.to_vec()
}

impl<B: FusionBackend + InvariantBackend> InvariantBackend for Fusion<B> {
    fn implementations(op: Op, device: &Self::Device, dtype: DType) -> Vec<Candidate> {
        B::implementations(op, device, dtype)
    }

    fn check_problem(
        implementation: Implementation,
        device: &Self::Device,
        dtype: DType,
        problem: Problem,
    ) -> Result<(), InvariantError> {
        B::check_problem(implementation, device, dtype, problem)
    }

    fn invariant_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let out = Shape::from(vec![shape_of(&lhs)[0], shape_of(&rhs)[1]]);
        let dtype = lhs.dtype;
        let primitive = Primitive::Matmul {
            bias: bias.is_some(),
        };
        let floats = [Some(lhs), Some(rhs), bias].into_iter().flatten().collect();
        register_one::<B>(
            "burn_invariant::matmul",
            primitive,
            implementation,
            floats,
            None,
            vec![],
            (out, dtype),
        )
    }

    fn invariant_matmul_grad_lhs(
        grad: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let out = Shape::from(vec![shape_of(&grad)[0], shape_of(&rhs)[0]]);
        let dtype = grad.dtype;
        register_one::<B>(
            "burn_invariant::matmul_grad_lhs",
            Primitive::MatmulGradLhs,
            implementation,
            vec![grad, rhs],
            None,
            vec![],
            (out, dtype),
        )
    }

    fn invariant_matmul_grad_rhs(
        lhs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let out = Shape::from(vec![shape_of(&lhs)[1], shape_of(&grad)[1]]);
        let dtype = grad.dtype;
        register_one::<B>(
            "burn_invariant::matmul_grad_rhs",
            Primitive::MatmulGradRhs,
            implementation,
            vec![lhs, grad],
            None,
            vec![],
            (out, dtype),
        )
    }

    fn invariant_sum_rows(
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let out = Shape::from(vec![shape_of(&grad)[1]]);
        let dtype = grad.dtype;
        register_one::<B>(
            "burn_invariant::sum_rows",
            Primitive::SumRows,
            implementation,
            vec![grad],
            None,
            vec![],
            (out, dtype),
        )
    }

    fn invariant_linear_logp(
        inputs: LinearLogpInputs<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let n = shape_of(&inputs.hidden)[0];
        let primitive = Primitive::LinearLogp {
            bias: inputs.bias.is_some(),
            ignore_index: inputs.ignore_index,
            head: inputs.head,
        };
        let floats = [Some(inputs.hidden), Some(inputs.weight), inputs.bias]
            .into_iter()
            .flatten()
            .collect();
        register_one::<B>(
            "burn_invariant::linear_logp",
            primitive,
            implementation,
            floats,
            Some(inputs.targets),
            vec![],
            (Shape::from(vec![n, inputs.head.columns()]), DType::F32),
        )
    }

    fn invariant_linear_logp_backward(
        inputs: LinearLogpInputs<Self>,
        stats: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        request: GradRequest,
        implementation: Implementation,
    ) -> LinearLogpGrads<Self> {
        let has_bias = inputs.bias.is_some();
        let request = GradRequest {
            bias: request.bias && has_bias,
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
        let primitive = Primitive::LinearLogpBackward {
            bias: has_bias,
            ignore_index: inputs.ignore_index,
            head: inputs.head,
            request,
        };
        let floats = [Some(inputs.hidden), Some(inputs.weight), inputs.bias]
            .into_iter()
            .flatten()
            .collect();
        let mut results = register::<B>(
            "burn_invariant::linear_logp_backward",
            primitive,
            implementation,
            floats,
            Some(inputs.targets),
            vec![stats, grad],
            outputs,
        )
        .into_iter();
        // `outputs` was built from the same `request` (one per requested gradient, in this
        // order), and `register` returns one tensor per output: the `expect`s cannot fire.
        LinearLogpGrads {
            hidden: request.hidden.then(|| results.next().expect("dHidden")),
            weight: request.weight.then(|| results.next().expect("dWeight")),
            bias: request.bias.then(|| results.next().expect("dBias")),
        }
    }
}
