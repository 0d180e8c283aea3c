//! Checks shared by the public functions; each returns the typed error of docs/CONTRACT.md, *Errors*.
use burn::tensor::{BasicOps, DType, Int, Tensor, TensorData, backend::Backend};

use crate::InvariantError;

/// Largest extent (and element count) a kernel indexes with 32-bit integers.
pub const INDEX_LIMIT: u64 = i32::MAX as u64;

pub(crate) fn float_dtype(arg: &'static str, dtype: DType) -> Result<(), InvariantError> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 | DType::F64 => Ok(()),
        got => Err(InvariantError::UnsupportedDtype {
            arg,
            expected: "F32, F16, BF16 (F64 on the NdArray reference)".into(),
            got,
        }),
    }
}

pub(crate) fn same_dtype(
    arg: &'static str,
    reference: &'static str,
    expected: DType,
    got: DType,
) -> Result<(), InvariantError> {
    if expected == got {
        Ok(())
    } else {
        Err(InvariantError::DtypeMismatch {
            arg,
            reference,
            expected,
            got,
        })
    }
}

pub(crate) fn same_device<B: Backend>(
    arg: &'static str,
    reference: &'static str,
    expected: &B::Device,
    got: &B::Device,
) -> Result<(), InvariantError> {
    if expected == got {
        Ok(())
    } else {
        Err(InvariantError::DeviceMismatch {
            arg,
            reference,
            expected: format!("{expected:?}"),
            got: format!("{got:?}"),
        })
    }
}

pub(crate) fn dim(
    arg: &'static str,
    shape: &[usize],
    axis: usize,
    expected: usize,
    what: &str,
) -> Result<(), InvariantError> {
    if shape[axis] == expected {
        Ok(())
    } else {
        Err(InvariantError::Shape {
            arg,
            expected: format!("dimension {axis} = {expected} ({what})"),
            got: shape.to_vec(),
        })
    }
}

/// Every extent and the element count fit 32-bit indexing.
pub(crate) fn index_limit(arg: &'static str, shape: &[usize]) -> Result<(), InvariantError> {
    for &extent in shape {
        if extent as u64 > INDEX_LIMIT {
            return Err(InvariantError::TooLarge {
                arg,
                what: "a dimension",
                got: extent as u64,
                limit: INDEX_LIMIT,
            });
        }
    }
    let elements = shape
        .iter()
        .try_fold(1u64, |acc, &e| acc.checked_mul(e as u64))
        .unwrap_or(u64::MAX);
    if elements > INDEX_LIMIT {
        return Err(InvariantError::TooLarge {
            arg,
            what: "the element count",
            got: elements,
            limit: INDEX_LIMIT,
        });
    }
    Ok(())
}

/// One host read of `t`; a failed read is [`InvariantError::Read`] naming `arg`.
pub(crate) fn host_data<B: Backend, const D: usize, K: BasicOps<B>>(
    t: Tensor<B, D, K>,
    arg: &'static str,
) -> Result<TensorData, InvariantError> {
    t.try_into_data().map_err(|e| InvariantError::Read {
        arg,
        reason: format!("{e:?}"),
    })
}

/// One host read of `targets`; every value in `[0, vocab)` or equal to `ignore_index`.
pub(crate) fn targets_in_range<B: Backend>(
    targets: &Tensor<B, 1, Int>,
    vocab: usize,
    ignore_index: Option<i64>,
) -> Result<(), InvariantError> {
    let data = host_data(targets.clone(), "targets")?;
    let mut first = None;
    let mut count = 0usize;
    for (index, value) in data.iter::<i64>().enumerate() {
        let in_range = value >= 0 && (value as u64) < vocab as u64;
        if !in_range && Some(value) != ignore_index {
            count += 1;
            first.get_or_insert((index, value));
        }
    }
    match first {
        None => Ok(()),
        Some((index, value)) => Err(InvariantError::TargetOutOfRange {
            index,
            value,
            vocab,
            count,
            ignore_index,
        }),
    }
}

/// One host read of a lengths tensor (`kv_lens`); every value in `[0, max]`.
pub(crate) fn lengths_in_range<B: Backend>(
    lengths: &Tensor<B, 1, Int>,
    arg: &'static str,
    max: usize,
) -> Result<(), InvariantError> {
    let data = host_data(lengths.clone(), arg)?;
    host_lengths_in_range(data.iter::<i64>(), arg, max)
}

/// Lengths on the host; every value in `[0, max]`.
pub(crate) fn host_lengths_in_range(
    lengths: impl IntoIterator<Item = i64>,
    arg: &'static str,
    max: usize,
) -> Result<(), InvariantError> {
    match lengths
        .into_iter()
        .enumerate()
        .find(|&(_, l)| l < 0 || l as u64 > max as u64)
    {
        None => Ok(()),
        Some((index, value)) => Err(InvariantError::InvalidArgument {
            arg,
            reason: format!("every length must be in [0, {max}]; element {index} is {value}"),
        }),
    }
}
