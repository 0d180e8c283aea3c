//! The crate's error type.

use thiserror::Error;

/// Everything a launch function can refuse. Every variant names the argument it is about.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KernelError {
    /// The dtype is not one this kernel supports (f32 / f16 / bf16 for floats, i32 / i64 for targets).
    #[error("argument `{arg}`: unsupported dtype {dtype} (supported: {supported})")]
    UnsupportedDtype {
        arg: &'static str,
        dtype: String,
        supported: &'static str,
    },
    /// The runtime/device cannot run this dtype (e.g. bf16 on wgpu/WGSL, i64 on WGSL).
    #[error(
        "argument `{arg}`: dtype {dtype} is not supported by runtime `{runtime}` on this device"
    )]
    DtypeNotSupportedByRuntime {
        arg: &'static str,
        dtype: String,
        runtime: String,
    },
    /// Wrong rank.
    #[error("argument `{arg}`: expected rank {expected}, got rank {got} (shape {shape:?})")]
    Rank {
        arg: &'static str,
        expected: usize,
        got: usize,
        shape: Vec<usize>,
    },
    /// Wrong shape.
    #[error("argument `{arg}`: expected shape {expected}, got {got:?}")]
    Shape {
        arg: &'static str,
        expected: String,
        got: Vec<usize>,
    },
    /// Strides do not fit the shape (e.g. a buffer too small for the described view).
    #[error("argument `{arg}`: layout invalid: {reason}")]
    Layout { arg: &'static str, reason: String },
    /// An output or workspace buffer is smaller than required.
    #[error("argument `{arg}`: buffer too small: need {needed} elements, got {got}")]
    BufferTooSmall {
        arg: &'static str,
        needed: usize,
        got: usize,
    },
    /// The kernel would need indices that do not fit in 32-bit (signed) arithmetic.
    #[error("argument `{arg}`: size overflows 32-bit kernel indexing ({what} = {value} > {limit})")]
    IndexOverflow {
        arg: &'static str,
        what: &'static str,
        value: u128,
        limit: u128,
    },
    /// The launch grid would exceed the runtime's maximum cube count.
    #[error("argument `{arg}`: launch grid too large ({what} = {value} > {limit})")]
    GridTooLarge {
        arg: &'static str,
        what: &'static str,
        value: u64,
        limit: u64,
    },
    /// A scalar argument outside its domain.
    #[error("invalid `{arg}`: {reason}")]
    InvalidArgument { arg: &'static str, reason: String },
    /// The requested kernel variant cannot run here (wrong dtype for the path, or a tiling the
    /// device cannot hold).
    #[error("{what}: not supported here: {reason}")]
    Unsupported { what: &'static str, reason: String },
}
