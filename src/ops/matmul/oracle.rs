//! The Reference arithmetic of `matmul` on host slices. Each output element is one
//! `f32::mul_add` chain in ascending reduction order, so a row's bits never depend on other rows;
//! rayon only spreads independent outputs over threads.
use rayon::prelude::*;

/// A read-only strided view of a row-major matrix (a transposed view swaps the strides).
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    /// Backing storage.
    pub data: &'a [f32],
    /// Logical rows.
    pub rows: usize,
    /// Logical columns.
    pub cols: usize,
    /// Distance between consecutive rows.
    pub row_stride: usize,
    /// Distance between consecutive columns.
    pub col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A dense row-major `[rows, cols]` matrix.
    ///
    /// # Panics
    /// When `data` does not hold `rows · cols` values. The oracle is a host-slice helper whose
    /// preconditions are slice lengths, like the standard slice methods; the Reference backend
    /// and the public Burn functions only pass consistent ones.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        assert_eq!(data.len(), rows * cols, "MatRef: data length");
        Self {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transposed view.
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    #[inline]
    fn at(&self, row: usize, col: usize) -> f32 {
        self.data[row * self.row_stride + col * self.col_stride]
    }
}

/// `lhs · rhs (+ bias)` → dense `[lhs.rows, rhs.cols]`:
/// `acc = 0; for k ascending { acc = lhs[i,k].mul_add(rhs[k,j], acc) }; out = acc + bias[j]`.
///
/// # Panics
/// When the inner dimensions differ, or a view's strides address past its slice.
pub fn gemm(lhs: MatRef<'_>, rhs: MatRef<'_>, bias: Option<&[f32]>) -> Vec<f32> {
    assert_eq!(lhs.cols, rhs.rows, "gemm: inner dimensions");
    let (k, n) = (lhs.cols, rhs.cols);
    let mut out = vec![0.0f32; lhs.rows * n];
    if n == 0 {
        return out;
    }
    out.par_chunks_mut(n).enumerate().for_each(|(i, row)| {
        // k outer, j inner: each out[i, j] still sees k in ascending order.
        for p in 0..k {
            let a = lhs.at(i, p);
            for (j, acc) in row.iter_mut().enumerate() {
                *acc = a.mul_add(rhs.at(p, j), *acc);
            }
        }
        if let Some(bias) = bias {
            for (acc, b) in row.iter_mut().zip(bias) {
                *acc += *b;
            }
        }
    });
    out
}

/// Column sums of `x`, rows in ascending order.
///
/// # Panics
/// When a view's strides address past its slice.
pub fn sum_rows(x: MatRef<'_>) -> Vec<f32> {
    let mut out = vec![0.0f32; x.cols];
    for i in 0..x.rows {
        for (j, acc) in out.iter_mut().enumerate() {
            *acc += x.at(i, j);
        }
    }
    out
}
