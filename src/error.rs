//! The crate's error type: every public function validates before any kernel runs and
//! returns one of these, naming the argument, what was expected and what was given.
use burn::tensor::DType;

use crate::registry::{Implementation, Op};

/// Why a `burn-invariant` call refused to run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvariantError {
    /// A dimension does not match what the other arguments imply.
    #[error("`{arg}`: expected {expected}, got shape {got:?}")]
    Shape {
        /// The offending argument.
        arg: &'static str,
        /// What the other arguments imply.
        expected: String,
        /// The shape that was given.
        got: Vec<usize>,
    },
    /// A dtype this operation (or the selected implementation) does not support.
    #[error("`{arg}`: dtype {got:?} is not supported, expected one of {expected}")]
    UnsupportedDtype {
        /// The offending argument.
        arg: &'static str,
        /// The supported dtypes.
        expected: String,
        /// The dtype that was given.
        got: DType,
    },
    /// Two arguments that must share a dtype do not.
    #[error("`{arg}`: expected dtype {expected:?} (the dtype of `{reference}`), got {got:?}")]
    DtypeMismatch {
        /// The offending argument.
        arg: &'static str,
        /// The argument whose dtype sets the expectation.
        reference: &'static str,
        /// The expected dtype.
        expected: DType,
        /// The dtype that was given.
        got: DType,
    },
    /// Arguments live on different devices.
    #[error("`{arg}`: expected device {expected} (the device of `{reference}`), got {got}")]
    DeviceMismatch {
        /// The offending argument.
        arg: &'static str,
        /// The argument whose device sets the expectation.
        reference: &'static str,
        /// The expected device.
        expected: String,
        /// The device that was given.
        got: String,
    },
    /// A target index outside `[0, vocab)` that is not the ignore index.
    #[error(
        "`targets`: {count} value(s) outside [0, {vocab}) and not equal to ignore_index {ignore_index:?}; first is targets[{index}] = {value}"
    )]
    TargetOutOfRange {
        /// Position of the first offending target.
        index: usize,
        /// Its value.
        value: i64,
        /// The vocabulary size (exclusive upper bound).
        vocab: usize,
        /// How many targets are out of range.
        count: usize,
        /// The ignore index in force.
        ignore_index: Option<i64>,
    },
    /// A size that would overflow the 32-bit indexing kernels use.
    #[error("`{arg}`: {what} = {got} exceeds the limit {limit}")]
    TooLarge {
        /// The offending argument.
        arg: &'static str,
        /// Which size.
        what: &'static str,
        /// The size that was given.
        got: u64,
        /// The largest size supported.
        limit: u64,
    },
    /// An option or scalar argument outside its domain.
    #[error("`{arg}`: {reason}")]
    InvalidArgument {
        /// The offending argument (`temperature`, …).
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// `BURN_INVARIANT_IMPL` holds a value that names no implementation.
    #[error("env BURN_INVARIANT_IMPL: expected one of `reference`, `cubecl`, `sm90`, got `{got}`")]
    InvalidOverride {
        /// The value found in the environment.
        got: String,
    },
    /// The requested (or forced) implementation cannot run this call.
    #[error(
        "{op:?} with {implementation:?} cannot run on {backend} device {device} for dtype {dtype:?}: {reason}"
    )]
    ImplementationUnavailable {
        /// The operation.
        op: Op,
        /// The implementation asked for.
        implementation: Implementation,
        /// The backend's name.
        backend: String,
        /// The device.
        device: String,
        /// The dtype of the call.
        dtype: DType,
        /// Why it cannot run.
        reason: String,
    },
    /// The selected implementation cannot run a call of these sizes.
    #[error("{implementation:?} cannot run {problem:?}: {reason}")]
    UnsupportedProblem {
        /// The implementation selected.
        implementation: Implementation,
        /// The sizes of the call.
        problem: crate::backend::Problem,
        /// Why.
        reason: String,
    },
    /// No implementation of this backend can run this call.
    #[error(
        "{op:?} has no implementation on {backend} device {device} for dtype {dtype:?}: {reasons}"
    )]
    NoImplementation {
        /// The operation.
        op: Op,
        /// The backend's name.
        backend: String,
        /// The device.
        device: String,
        /// The dtype of the call.
        dtype: DType,
        /// Why each candidate was refused.
        reasons: String,
    },
    /// Tensor parallel (`tp`): the ranks' vocabulary shards do not form a contiguous partition
    /// of `[0, V_global)`.
    #[error(
        "`shard` of rank {rank}: the shards must partition [0, V_global) in rank order: expected {expected}, got {got}"
    )]
    Partition {
        /// The first rank whose shard breaks the partition.
        rank: usize,
        /// What the other ranks imply.
        expected: String,
        /// What that rank declared.
        got: String,
    },
    /// Tensor parallel (`tp`): a quantity that must be equal on every rank is not.
    #[error(
        "tensor-parallel ranks disagree on {what}: rank 0 has {expected}, rank {rank} has {got}"
    )]
    RankMismatch {
        /// The quantity (e.g. "N (rows of `hidden`)").
        what: &'static str,
        /// The first rank that differs from rank 0.
        rank: usize,
        /// Rank 0's value.
        expected: String,
        /// That rank's value.
        got: String,
    },
    /// Tensor parallel (`tp`): one rank's own checks failed; every rank returns this error.
    #[error("tensor-parallel rank {rank} of {world} rejected its inputs: {reason}")]
    RankFailed {
        /// The lowest failing rank.
        rank: usize,
        /// The world size.
        world: usize,
        /// That rank's error, as text (the same on every rank).
        reason: String,
    },
    /// Tensor parallel (`tp`): a collective operation failed (timeout, a rank that left, blocks
    /// of different sizes).
    #[error("collective operation failed: {reason}")]
    Collective {
        /// What went wrong, naming the ranks involved.
        reason: String,
    },
    /// A kernel launch on this device failed earlier in the process (a kernel the device's
    /// compiler rejected, a launch the driver refused): what ran since cannot be trusted, so
    /// every later call on the device returns this error, the failed call included where it
    /// ran before returning.
    #[error(
        "a burn-invariant launch on device {device} failed, so no later call there is trusted: {reason}"
    )]
    DeviceFailed {
        /// The device.
        device: String,
        /// The runtime's message of the first failure.
        reason: String,
    },
    /// Reading tensor data back to the host failed.
    #[error("reading `{arg}` back to the host failed: {reason}")]
    Read {
        /// The argument being read.
        arg: &'static str,
        /// The backend's message.
        reason: String,
    },
}
