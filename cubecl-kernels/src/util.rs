//! Host-side validation helpers and dtype plumbing.

use crate::consts::MAX_INDEX;
use crate::error::KernelError;
use cubecl::features::TypeUsage;
use cubecl::ir::{ElemType, FloatKind, IntKind, StorageType};
use cubecl::prelude::*;

/// The float dtypes the kernels accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FloatDType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
}

impl FloatDType {
    /// The CubeCL storage type.
    pub fn storage(self) -> StorageType {
        let kind = match self {
            FloatDType::F32 => FloatKind::F32,
            FloatDType::F16 => FloatKind::F16,
            FloatDType::BF16 => FloatKind::BF16,
        };
        StorageType::Scalar(ElemType::Float(kind))
    }

    /// Size in bytes.
    pub fn size(self) -> usize {
        match self {
            FloatDType::F32 => 4,
            FloatDType::F16 | FloatDType::BF16 => 2,
        }
    }

    /// Classify a storage type (`burn::tensor::DType` converts into `StorageType` with `.into()`).
    pub fn from_storage(arg: &'static str, dtype: StorageType) -> Result<Self, KernelError> {
        match dtype {
            StorageType::Scalar(ElemType::Float(FloatKind::F32)) => Ok(FloatDType::F32),
            StorageType::Scalar(ElemType::Float(FloatKind::F16)) => Ok(FloatDType::F16),
            StorageType::Scalar(ElemType::Float(FloatKind::BF16)) => Ok(FloatDType::BF16),
            other => Err(KernelError::UnsupportedDtype {
                arg,
                dtype: format!("{other:?}"),
                supported: "f32, f16, bf16",
            }),
        }
    }
}

impl From<FloatDType> for StorageType {
    fn from(value: FloatDType) -> Self {
        value.storage()
    }
}

/// The integer dtypes accepted for `targets`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IndexDType {
    /// i32 targets.
    I32,
    /// i64 targets (where [`runtime_supports`] reports i64: CUDA; also wgpu/WGSL in cubecl 0.10).
    I64,
}

impl IndexDType {
    /// The CubeCL storage type.
    pub fn storage(self) -> StorageType {
        match self {
            IndexDType::I32 => StorageType::Scalar(ElemType::Int(IntKind::I32)),
            IndexDType::I64 => StorageType::Scalar(ElemType::Int(IntKind::I64)),
        }
    }

    /// Size in bytes.
    pub fn size(self) -> usize {
        match self {
            IndexDType::I32 => 4,
            IndexDType::I64 => 8,
        }
    }

    /// Classify a storage type.
    pub fn from_storage(arg: &'static str, dtype: StorageType) -> Result<Self, KernelError> {
        match dtype {
            StorageType::Scalar(ElemType::Int(IntKind::I32)) => Ok(IndexDType::I32),
            StorageType::Scalar(ElemType::Int(IntKind::I64)) => Ok(IndexDType::I64),
            other => Err(KernelError::UnsupportedDtype {
                arg,
                dtype: format!("{other:?}"),
                supported: "i32, i64",
            }),
        }
    }
}

/// Whether the runtime on this client can hold `dtype` in buffers and convert it.
pub fn runtime_supports<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> bool {
    let usage = client.features().type_usage(dtype);
    usage.contains(TypeUsage::Conversion) && usage.contains(TypeUsage::Buffer)
}

pub(crate) fn check_runtime_dtype<R: Runtime>(
    client: &ComputeClient<R>,
    arg: &'static str,
    dtype: StorageType,
) -> Result<(), KernelError> {
    if runtime_supports(client, dtype) {
        Ok(())
    } else {
        Err(KernelError::DtypeNotSupportedByRuntime {
            arg,
            dtype: format!("{dtype:?}"),
            runtime: R::name(client).to_string(),
        })
    }
}

/// A validated strided view: shape, strides (in elements) and the buffer length in elements.
#[derive(Debug, Clone)]
pub(crate) struct View {
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

impl View {
    pub fn dim(&self, d: usize) -> usize {
        self.shape[d]
    }
    pub fn stride(&self, d: usize) -> usize {
        self.strides[d]
    }
}

pub(crate) fn to_u32(arg: &'static str, what: &'static str, v: usize) -> Result<u32, KernelError> {
    if (v as u128) > MAX_INDEX {
        return Err(KernelError::IndexOverflow {
            arg,
            what,
            value: v as u128,
            limit: MAX_INDEX,
        });
    }
    Ok(v as u32)
}

/// Check rank, that every addressed element lies inside the buffer, and that every offset fits
/// the kernels' 32-bit addressing.
pub(crate) fn check_view<R: Runtime>(
    arg: &'static str,
    t: &TensorBinding<R>,
    rank: usize,
    elem_size: usize,
) -> Result<View, KernelError> {
    let shape: Vec<usize> = t.shape.iter().copied().collect();
    let strides: Vec<usize> = t.strides.iter().copied().collect();
    if shape.len() != rank || strides.len() != rank {
        return Err(KernelError::Rank {
            arg,
            expected: rank,
            got: shape.len(),
            shape,
        });
    }
    let buf_elems = (t.handle.size_in_used() as usize) / elem_size;
    if buf_elems as u128 > MAX_INDEX + 1 {
        return Err(KernelError::IndexOverflow {
            arg,
            what: "buffer elements",
            value: buf_elems as u128,
            limit: MAX_INDEX + 1,
        });
    }
    if shape.iter().all(|&s| s > 0) {
        let mut max_off: u128 = 0;
        for d in 0..rank {
            max_off += (shape[d] as u128 - 1) * strides[d] as u128;
        }
        if max_off > MAX_INDEX {
            return Err(KernelError::IndexOverflow {
                arg,
                what: "largest element offset",
                value: max_off,
                limit: MAX_INDEX,
            });
        }
        if max_off >= buf_elems as u128 {
            return Err(KernelError::Layout {
                arg,
                reason: format!(
                    "shape {shape:?} with strides {strides:?} addresses element {max_off}, \
                     but the buffer holds {buf_elems} elements"
                ),
            });
        }
        // A stride of an extent-1 dimension is never multiplied by a nonzero index.
        for (&st, _) in strides.iter().zip(&shape).filter(|(_, s)| **s > 1) {
            if st as u128 > MAX_INDEX {
                return Err(KernelError::IndexOverflow {
                    arg,
                    what: "stride",
                    value: st as u128,
                    limit: MAX_INDEX,
                });
            }
        }
    }
    Ok(View { shape, strides })
}

/// Same as [`check_view`] for an output: additionally rejects views whose distinct logical
/// elements could alias (a zero stride on a dimension longer than 1). A view with no elements
/// has nothing to alias (Burn gives empty tensors zero strides).
pub(crate) fn check_out_view<R: Runtime>(
    arg: &'static str,
    t: &TensorBinding<R>,
    rank: usize,
    elem_size: usize,
) -> Result<View, KernelError> {
    let v = check_view(arg, t, rank, elem_size)?;
    if v.shape.contains(&0) {
        return Ok(v);
    }
    for d in 0..rank {
        if v.shape[d] > 1 && v.strides[d] == 0 {
            return Err(KernelError::Layout {
                arg,
                reason: format!(
                    "output has stride 0 on dimension {d} of length {}",
                    v.shape[d]
                ),
            });
        }
    }
    Ok(v)
}

pub(crate) fn expect_shape(
    arg: &'static str,
    v: &View,
    expected: &[usize],
) -> Result<(), KernelError> {
    if v.shape != expected {
        return Err(KernelError::Shape {
            arg,
            expected: format!("{expected:?}"),
            got: v.shape.clone(),
        });
    }
    Ok(())
}

pub(crate) fn check_grid<R: Runtime>(
    client: &ComputeClient<R>,
    arg: &'static str,
    x: usize,
    y: usize,
) -> Result<(u32, u32), KernelError> {
    let (mx, my, _) = client.properties().hardware.max_cube_count;
    if x as u64 > mx as u64 {
        return Err(KernelError::GridTooLarge {
            arg,
            what: "cubes along x",
            value: x as u64,
            limit: mx as u64,
        });
    }
    if y as u64 > my as u64 {
        return Err(KernelError::GridTooLarge {
            arg,
            what: "cubes along y",
            value: y as u64,
            limit: my as u64,
        });
    }
    Ok((x as u32, y as u32))
}

/// Raw buffer argument for a binding with a 1-D shape covering `len` elements
/// (the kernels do their own addressing from explicit offsets and strides).
pub(crate) fn raw_arg<R: Runtime>(t: &TensorBinding<R>) -> TensorArg<R> {
    t.clone().into_tensor_arg()
}

/// `(start, len)` of the fixed chunks of `size` that cover `0..total`, ascending (none when
/// `total` is 0).
pub(crate) fn chunks(total: usize, size: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..total)
        .step_by(size.max(1))
        .map(move |start| (start, size.min(total - start)))
}

/// `(start, len)` of the launches that cover `total` items, `per_cube` items per cube, within the
/// runtime's cube count along `axis` (0: x, 1: y); one launch where it fits. Only for kernels
/// that compute every item independently of the others, so the split never changes a bit.
pub(crate) fn launch_chunks<R: Runtime>(
    client: &ComputeClient<R>,
    axis: usize,
    total: usize,
    per_cube: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let (mx, my, _) = client.properties().hardware.max_cube_count;
    let cubes = if axis == 0 { mx } else { my } as usize;
    chunks(total, cubes.max(1) * per_cube)
}

/// Runs `f` with this thread's `flag` set (a test hook's switch), restoring its previous value
/// when `f` returns or unwinds; other threads are unaffected. Shared with `burn-invariant`'s hooks.
#[doc(hidden)]
pub fn with_thread_flag<T>(
    flag: &'static std::thread::LocalKey<std::cell::Cell<bool>>,
    f: impl FnOnce() -> T,
) -> T {
    with_thread_value(flag, true, f)
}

/// Runs `f` with this thread's `key` holding `value`, restoring its previous value when `f`
/// returns or unwinds; other threads are unaffected.
pub(crate) fn with_thread_value<V: Copy + 'static, T>(
    key: &'static std::thread::LocalKey<std::cell::Cell<V>>,
    value: V,
    f: impl FnOnce() -> T,
) -> T {
    struct Restore<V: Copy + 'static>(&'static std::thread::LocalKey<std::cell::Cell<V>>, V);
    impl<V: Copy + 'static> Drop for Restore<V> {
        fn drop(&mut self) {
            self.0.with(|cell| cell.set(self.1));
        }
    }
    let _restore = Restore(key, key.with(|cell| cell.replace(value)));
    f()
}
