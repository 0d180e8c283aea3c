//! The per-row steps of the segment algorithm as plain Burn ops: the default of the
//! `invariant_tp_*` primitives (the reference on NdArray; `Fusion` fuses them). `CubeBackend`
//! runs each as one kernel of `burn_invariant_cubecl::tp` with the same arithmetic.
use burn::tensor::{Int, Tensor, ops::FloatTensor, ops::IntTensor};

use super::engine::{raw, wrap as float};
use crate::InvariantBackend;

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
    let (a, b) = (float::<B, 1>(a), float::<B, 1>(b));
    let max = a.clone().max_pair(b.clone());
    let same = a.clone().equal(b.clone());
    let gap = (a - b).abs().neg().mask_fill(same, 0.0);
    raw(max + gap.exp().log1p())
}

pub(crate) fn pick<B: InvariantBackend>(
    acc: Option<FloatTensor<B>>,
    stats: FloatTensor<B>,
    leaf_targets: IntTensor<B>,
) -> FloatTensor<B> {
    let picked = float::<B, 2>(stats).swap_dims(0, 1);
    let owned = int::<B>(leaf_targets)
        .greater_equal_elem(0)
        .unsqueeze_dim::<2>(0)
        .repeat_dim(0, 2);
    let out = match acc {
        Some(acc) => float::<B, 2>(acc).mask_where(owned, picked),
        None => picked.mask_fill(owned.bool_not(), 0.0),
    };
    raw(out)
}

pub(crate) fn finish<B: InvariantBackend>(
    picks: FloatTensor<B>,
    lse: FloatTensor<B>,
    targets: IntTensor<B>,
    vocab: usize,
    ignore_index: Option<i64>,
) -> FloatTensor<B> {
    let picks = float::<B, 2>(picks);
    let lse = float::<B, 1>(lse);
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
    raw(Tensor::stack::<2>(vec![logp, lse], 1))
}
