//! Operands as the TMA engine reads them.
use burn::tensor::{Shape, ops::FloatTensorOps};
use burn_cubecl::ops::numeric::zeros_client;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::server::{Binding, TensorMapBinding, TensorMapMeta};
use cubecl::zspace::metadata::Metadata;

use crate::backends::cuda::{CudaOps, CudaTensor};

/// A TMA-readable operand: a row-major buffer whose row stride is a multiple of 16 bytes and
/// whose base is 16-byte aligned (copied into such a buffer when it is not).
pub(crate) struct TmaOperand {
    tensor: CudaTensor,
    cols: usize,
    ld: usize,
}

impl TmaOperand {
    pub(crate) fn new(t: CudaTensor) -> Self {
        let cols = t.meta.shape()[1];
        let strides = t.meta.strides().to_vec();
        let elem = t.dtype.size();
        // cubecl's CUDA allocations are 512-byte aligned, so the base is 16-byte aligned exactly
        // when the view's byte offset is: TMA needs both that and 16-byte row strides.
        let aligned_base = t.handle.offset_start.unwrap_or(0).is_multiple_of(16);
        let tma_ready = strides[1] == 1
            && (strides[0] * elem).is_multiple_of(16)
            && strides[0] >= cols
            && aligned_base;
        let (tensor, ld) = if tma_ready {
            let ld = strides[0];
            (t, ld)
        } else {
            padded_copy(t)
        };
        Self { tensor, cols, ld }
    }

    /// A map of rows `[row0, row0 + rows)` of this operand.
    pub(crate) fn map(&self, row0: usize, rows: usize) -> TensorMapBinding {
        self.map_columns(row0, rows, self.cols)
    }

    /// A map of the first `cols` columns of rows `[row0, row0 + rows)`: box 64×64, 128-byte
    /// swizzle, zero fill out of bounds (the kernels rely on it for every tail), L2 promotion
    /// 256 B.
    pub(crate) fn map_columns(&self, row0: usize, rows: usize, cols: usize) -> TensorMapBinding {
        let elem = self.tensor.dtype.size();
        let binding = self
            .tensor
            .handle
            .clone()
            .offset_start((row0 * self.ld * elem) as u64)
            .binding();
        let meta = TensorMapMeta {
            format: TensorMapFormat::Tiled(TiledArgs::new([64usize, 64].into())),
            metadata: Metadata::new([rows.max(1), cols.max(1)], [self.ld, 1]),
            elem_stride: [1usize, 1].into(),
            interleave: TensorMapInterleave::None,
            swizzle: TensorMapSwizzle::B128,
            prefetch: TensorMapPrefetch::B256,
            oob_fill: OobFill::Zero,
            storage_ty: self.tensor.dtype.into(),
        };
        TensorMapBinding::new(binding, meta)
    }

    /// The buffer itself (cubecl orders only buffer arguments across streams).
    pub(crate) fn binding(&self) -> Binding {
        self.tensor.handle.clone().binding()
    }
}

/// Copies `t` into a TMA-readable buffer and returns it with its row stride.
///
/// cubecl's pitched copy (rows on the allocator's pitch, 16-byte multiples on CUDA) reads any
/// strides. Zeros + `slice_assign` from a dense source with odd rows gave wrong rows ≥ 1 under
/// Fusion (whose outputs are dense), so that path only ever sees the pitched copy.
fn padded_copy(t: CudaTensor) -> (CudaTensor, usize) {
    let (rows, cols) = (t.meta.shape()[0], t.meta.shape()[1]);
    let (client, device, dtype) = (t.client.clone(), t.device.clone(), t.dtype);
    let pitched = cubecl::std::tensor::into_contiguous_pitched(&client, t.binding(), dtype.into());
    let pitched = CubeTensor::new(
        client.clone(),
        pitched.handle,
        *pitched.metadata,
        device.clone(),
        dtype,
    );
    let ld = pitched.meta.strides()[0];
    if pitched.meta.strides()[1] == 1 && (ld * dtype.size()).is_multiple_of(16) && ld >= cols {
        return (pitched, ld);
    }
    let ld = cols.div_ceil(8).max(1) * 8;
    let wide = zeros_client(client, device, Shape::new([rows, ld]), dtype);
    let window = [(0..rows).into(), (0..cols).into()];
    (CudaOps::float_slice_assign(wide, &window, pitched), ld)
}
