//! Default bodies of `InvariantBackend` methods in plain Burn ops: the per-row steps of the
//! tensor-parallel segment algorithm (the reference on NdArray; `Fusion` fuses them).
//! `CubeBackend` runs each as one kernel of `burn_invariant_cubecl::tp` with the same
//! arithmetic. Also the conversions between tensors and primitives the crate uses.
use burn::tensor::{
    Int, Tensor, TensorPrimitive, backend::Backend, ops::FloatTensor, ops::IntTensor,
};

use crate::InvariantBackend;

/// A float primitive as a tensor.
pub(crate) fn float_tensor<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// A float tensor's primitive.
pub(crate) fn float_primitive<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn int<B: InvariantBackend>(t: IntTensor<B>) -> Tensor<B, 1, Int> {
    Tensor::from_primitive(t)
}

pub(crate) fn leaf_targets<B: InvariantBackend>(
    targets: IntTensor<B>,
    start: usize,
    end: usize,
    ignore_index: Option<i64>,
) -> IntTensor<B> {
    let t = int::<B>(targets);
    let inside = t
        .clone()
        .greater_equal_elem(start as i64)
        .bool_and(t.clone().lower_elem(end as i64));
    let mut out = t
        .clone()
        .sub_scalar(start as i64)
        .mask_fill(inside.bool_not(), -2);
    if let Some(ignore) = ignore_index {
        out = out.mask_fill(t.equal_elem(ignore), -1);
    }
    out.into_primitive()
}

pub(crate) fn merge_lse<B: InvariantBackend>(
    a: FloatTensor<B>,
    b: FloatTensor<B>,
) -> FloatTensor<B> {
    let (a, b) = (float_tensor::<B, 1>(a), float_tensor::<B, 1>(b));
    let max = a.clone().max_pair(b.clone());
    let same = a.clone().equal(b.clone());
    let gap = (a - b).abs().neg().mask_fill(same, 0.0);
    float_primitive(max + gap.exp().log1p())
}

pub(crate) fn merge_entropy<B: InvariantBackend>(
    a: FloatTensor<B>,
    b: FloatTensor<B>,
) -> FloatTensor<B> {
    let (a, b) = (float_tensor::<B, 2>(a), float_tensor::<B, 2>(b));
    let n = a.dims()[1];
    let row = |t: &Tensor<B, 2>, i: usize| t.clone().slice([i..i + 1, 0..n]).reshape([n]);
    let (la, ha, lb, hb) = (row(&a, 0), row(&a, 1), row(&b, 0), row(&b, 1));
    let lse = float_tensor::<B, 1>(merge_lse::<B>(
        float_primitive(la.clone()),
        float_primitive(lb.clone()),
    ));
    let side = |l: Tensor<B, 1>, h: Tensor<B, 1>| {
        let gap = l.clone() - lse.clone();
        let empty = l.equal_elem(f32::NEG_INFINITY);
        (gap.clone().exp() * (h - gap)).mask_fill(empty, 0.0)
    };
    let h = side(la, ha) + side(lb, hb);
    float_primitive(Tensor::stack::<2>(vec![lse, h], 0))
}

pub(crate) fn pick<B: InvariantBackend>(
    acc: Option<FloatTensor<B>>,
    stats: FloatTensor<B>,
    leaf_targets: IntTensor<B>,
) -> FloatTensor<B> {
    let picked = float_tensor::<B, 2>(stats).swap_dims(0, 1);
    let owned = int::<B>(leaf_targets)
        .greater_equal_elem(0)
        .unsqueeze_dim::<2>(0)
        .repeat_dim(0, 2);
    let out = match acc {
        Some(acc) => float_tensor::<B, 2>(acc).mask_where(owned, picked),
        None => picked.mask_fill(owned.bool_not(), 0.0),
    };
    float_primitive(out)
}

pub(crate) fn finish<B: InvariantBackend>(
    picks: FloatTensor<B>,
    lse: FloatTensor<B>,
    targets: IntTensor<B>,
    vocab: usize,
    ignore_index: Option<i64>,
) -> FloatTensor<B> {
    let picks = float_tensor::<B, 2>(picks);
    let lse = float_tensor::<B, 1>(lse);
    let n = lse.dims()[0];
    let t = int::<B>(targets);
    let row = |i: usize| picks.clone().slice([i..i + 1, 0..n]).reshape([n]);
    let in_range = t
        .clone()
        .greater_equal_elem(0)
        .bool_and(t.clone().lower_elem(vocab.min(i64::MAX as usize) as i64));
    let mut logp = (row(0) + (row(1) - lse.clone())).mask_fill(in_range.bool_not(), f32::NAN);
    if let Some(ignore) = ignore_index {
        logp = logp.mask_fill(t.equal_elem(ignore), 0.0);
    }
    float_primitive(Tensor::stack::<2>(vec![logp, lse], 1))
}
