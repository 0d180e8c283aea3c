//! Which implementation runs an op: the one place that decides. From the candidates a backend
//! offers for (op, device, dtype) ([`InvariantBackend::implementations`]), the
//! `BURN_INVARIANT_IMPL` override and the kernels' limits for the call's sizes
//! ([`InvariantBackend::check_problem`]) it picks an [`Implementation`], or refuses with a
//! reason. The public functions ask it once per call and pass the choice to the primitives;
//! nothing else chooses.
use std::any::TypeId;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, OnceLock};

use burn::tensor::DType;
use burn::tensor::backend::{DeviceId, DeviceOps};

use crate::{InvariantBackend, InvariantError};

/// Environment variable that forces one implementation for every op.
pub const OVERRIDE_ENV: &str = "BURN_INVARIANT_IMPL";

/// The three implementations of every op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Implementation {
    /// Plain Rust on NdArray: the oracle.
    Reference,
    /// Portable CubeCL kernels (CUDA, wgpu, ROCm).
    CubeCl,
    /// Hand-written TMA + WGMMA kernels for CUDA compute capability 9.0.
    Sm90,
}

impl Implementation {
    /// The name accepted by `BURN_INVARIANT_IMPL`.
    pub fn env_name(self) -> &'static str {
        match self {
            Implementation::Reference => "reference",
            Implementation::CubeCl => "cubecl",
            Implementation::Sm90 => "sm90",
        }
    }

    fn from_env_name(value: &str) -> Option<Self> {
        [Self::Reference, Self::CubeCl, Self::Sm90]
            .into_iter()
            .find(|imp| imp.env_name().eq_ignore_ascii_case(value.trim()))
    }
}

/// The ops the registry dispatches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `matmul` / `linear`, forward and both backward products.
    Matmul,
    /// `linear_logp` forward and backward.
    LinearLogp,
    /// `attention` forward and backward.
    Attention,
    /// `rms_norm` forward and backward.
    RmsNorm,
}

/// The sizes of one call: what the registry decides by, with
/// [`InvariantBackend::check_problem`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    /// `[m, k] · [k, n]`.
    Matmul {
        /// Rows.
        m: usize,
        /// Reduction size.
        k: usize,
        /// Output features.
        n: usize,
    },
    /// `hidden [n, d]`, `weight [v, d]`.
    LinearLogp {
        /// Rows.
        n: usize,
        /// Hidden size.
        d: usize,
        /// Vocabulary size.
        v: usize,
    },
    /// `query [batch, heads, q_len, head_dim]`, `key`/`value [batch, kv_heads, kv_len, head_dim]`.
    Attention {
        /// Rows.
        batch: usize,
        /// Query heads.
        heads: usize,
        /// Key/value heads.
        kv_heads: usize,
        /// Queries per row.
        q_len: usize,
        /// Keys per row.
        kv_len: usize,
        /// Head size.
        head_dim: usize,
    },
    /// `x [n, d]`, `gamma [d]`.
    RmsNorm {
        /// Rows.
        n: usize,
        /// Normalized size.
        d: usize,
    },
}

impl Op {
    /// The op a call of these sizes runs.
    fn of(problem: Problem) -> Self {
        match problem {
            Problem::Matmul { .. } => Op::Matmul,
            Problem::LinearLogp { .. } => Op::LinearLogp,
            Problem::Attention { .. } => Op::Attention,
            Problem::RmsNorm { .. } => Op::RmsNorm,
        }
    }
}

/// One implementation a backend offers for an (op, device, dtype), and whether it can run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The implementation.
    pub implementation: Implementation,
    /// `Ok` when it can run, otherwise why not.
    pub availability: Result<(), String>,
    /// The device's architecture calls for this implementation, but this host lacks what it
    /// needs (a toolchain, a library): no other candidate may stand in for it, since that would
    /// compute other bits than the same device on a host that has it.
    pub required: bool,
}

impl Candidate {
    /// An implementation that can run.
    pub fn available(implementation: Implementation) -> Self {
        Self {
            implementation,
            availability: Ok(()),
            required: false,
        }
    }

    /// An implementation that exists on this backend but cannot run this call.
    pub fn unavailable(implementation: Implementation, reason: impl Into<String>) -> Self {
        Self {
            implementation,
            availability: Err(reason.into()),
            required: false,
        }
    }

    /// The device's own implementation, which this host cannot run (see [`Candidate::required`]).
    pub fn missing_on_host(implementation: Implementation, reason: impl Into<String>) -> Self {
        Self {
            implementation,
            availability: Err(reason.into()),
            required: true,
        }
    }
}

/// The implementation forced by `BURN_INVARIANT_IMPL`, if any. Read at every call (without an
/// allocation when unset), so a change made while the program runs takes effect.
pub fn forced_implementation() -> Result<Option<Implementation>, InvariantError> {
    let Some(value) = std::env::var_os(OVERRIDE_ENV) else {
        return Ok(None);
    };
    let value = value.to_string_lossy();
    if value.trim().is_empty() {
        return Ok(None);
    }
    Implementation::from_env_name(&value)
        .map(Some)
        .ok_or_else(|| InvariantError::InvalidOverride {
            got: value.into_owned(),
        })
}

/// What decides a choice: the backend type, the op, the dtype, the device and the override.
type ChoiceKey = (TypeId, Op, DType, DeviceId, Option<Implementation>);

thread_local! {
    /// Choices already made on this thread: a backend's candidates are fixed for a device, so
    /// a call after the first costs one lookup (no lock, no allocation).
    static CHOICES: RefCell<HashMap<ChoiceKey, Implementation>> = RefCell::new(HashMap::new());
}

/// Which implementation runs `op` on `device` for `dtype`, or the error the call would return.
///
/// Without an override this is the first available candidate of the backend (its preference
/// order), unless a candidate before it is required by the device but missing on this host
/// (Sm90 on a Hopper GPU without NVRTC or the CUDA headers): then an error, since another host
/// with the same GPU would run other kernels. With `BURN_INVARIANT_IMPL` set it is that
/// implementation or an error, never a silent fallback.
pub fn implementation_for<B: InvariantBackend>(
    op: Op,
    device: &B::Device,
    dtype: DType,
) -> Result<Implementation, InvariantError> {
    let forced = forced_implementation()?;
    let key = (TypeId::of::<B>(), op, dtype, device.id(), forced);
    if let Some(chosen) = CHOICES.with(|choices| choices.borrow().get(&key).copied()) {
        return Ok(chosen);
    }
    let chosen = choose::<B>(op, device, dtype, forced)?;
    CHOICES.with(|choices| choices.borrow_mut().insert(key, chosen));
    Ok(chosen)
}

/// The choice from the backend's candidates, or the error; logs the first use of each.
fn choose<B: InvariantBackend>(
    op: Op,
    device: &B::Device,
    dtype: DType,
    forced: Option<Implementation>,
) -> Result<Implementation, InvariantError> {
    let candidates = B::implementations(op, device, dtype);
    let backend = || B::name(device);
    let chosen = match forced {
        Some(forced) => match candidates.iter().find(|c| c.implementation == forced) {
            Some(Candidate {
                availability: Ok(()),
                ..
            }) => forced,
            Some(Candidate {
                availability: Err(reason),
                ..
            }) => {
                return Err(InvariantError::ImplementationUnavailable {
                    op,
                    implementation: forced,
                    backend: backend(),
                    device: format!("{device:?}"),
                    dtype,
                    reason: format!("forced by {OVERRIDE_ENV}, but {reason}"),
                });
            }
            None => {
                return Err(InvariantError::ImplementationUnavailable {
                    op,
                    implementation: forced,
                    backend: backend(),
                    device: format!("{device:?}"),
                    dtype,
                    reason: format!(
                        "forced by {OVERRIDE_ENV}, but this backend offers only {:?}",
                        candidates
                            .iter()
                            .map(|c| c.implementation)
                            .collect::<Vec<_>>()
                    ),
                });
            }
        },
        None => match candidates
            .iter()
            .find(|c| c.availability.is_ok() || c.required)
        {
            Some(Candidate {
                implementation,
                availability: Err(reason),
                ..
            }) => {
                let portable = candidates
                    .iter()
                    .find(|c| c.availability.is_ok())
                    .map(|c| c.implementation.env_name());
                return Err(InvariantError::ImplementationUnavailable {
                    op,
                    implementation: *implementation,
                    backend: backend(),
                    device: format!("{device:?}"),
                    dtype,
                    reason: match portable {
                        Some(name) => format!(
                            "it is this device's implementation, but {reason}; \
                             {OVERRIDE_ENV}={name} runs the portable kernels instead, \
                             with other bits than this device elsewhere"
                        ),
                        None => format!("it is this device's implementation, but {reason}"),
                    },
                });
            }
            Some(candidate) => candidate.implementation,
            None => {
                let reasons = candidates
                    .iter()
                    .map(|c| {
                        format!(
                            "{:?}: {}",
                            c.implementation,
                            c.availability.as_ref().err().map_or("", String::as_str)
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ");
                return Err(InvariantError::NoImplementation {
                    op,
                    backend: backend(),
                    device: format!("{device:?}"),
                    dtype,
                    reasons,
                });
            }
        },
    };
    log_first_use(op, &backend(), &format!("{device:?}"), chosen);
    Ok(chosen)
}

fn log_first_use(op: Op, backend: &str, device: &str, implementation: Implementation) {
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let key = format!("{op:?}/{backend}/{device}/{implementation:?}");
    let mut seen = SEEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if seen.insert(key) {
        log::info!("burn-invariant: {op:?} on {backend} {device} runs {implementation:?}");
    }
}

/// Which implementation runs a call of `problem`'s op and sizes on `device` for `dtype`: the
/// entry point of the public functions. [`implementation_for`] (candidates and override), then
/// the chosen one's limits. Where the preferred implementation refuses these sizes for a reason
/// other than the number of rows (Sm90 and D = 0), the next available one that takes them runs
/// instead. A forced implementation that refuses them is an error.
pub(crate) fn implementation_for_problem<B: InvariantBackend>(
    device: &B::Device,
    dtype: DType,
    problem: Problem,
) -> Result<Implementation, InvariantError> {
    if let Some(failed) = B::invariant_device_failure(device) {
        return Err(failed);
    }
    let op = Op::of(problem);
    let chosen = implementation_for::<B>(op, device, dtype)?;
    let Err(refused) = B::check_problem(chosen, device, dtype, problem) else {
        return Ok(chosen);
    };
    // No other choice when forced, or when the refusal is for the number of rows alone:
    // choosing by rows would break row invariance.
    if forced_implementation()?.is_some()
        || B::check_problem(chosen, device, dtype, one_row(problem)).is_ok()
    {
        return Err(refused);
    }
    B::implementations(op, device, dtype)
        .into_iter()
        .filter(|c| c.availability.is_ok())
        .map(|c| c.implementation)
        .find(|&imp| B::check_problem(imp, device, dtype, problem).is_ok())
        .ok_or(refused)
}

/// After a public call's primitive: the failure of a launch seen on `device`
/// ([`InvariantError::DeviceFailed`]), where the primitive ran before returning (unfused
/// backends) and failed, or an earlier call failed.
pub(crate) fn check_device<B: InvariantBackend>(device: &B::Device) -> Result<(), InvariantError> {
    B::invariant_device_failure(device).map_or(Ok(()), Err)
}

/// `problem` with one row (one query of one batch row for attention).
fn one_row(problem: Problem) -> Problem {
    match problem {
        Problem::Matmul { k, n, .. } => Problem::Matmul { m: 1, k, n },
        Problem::LinearLogp { d, v, .. } => Problem::LinearLogp { n: 1, d, v },
        Problem::Attention {
            heads,
            kv_heads,
            kv_len,
            head_dim,
            ..
        } => Problem::Attention {
            batch: 1,
            heads,
            kv_heads,
            q_len: 1,
            kv_len,
            head_dim,
        },
        Problem::RmsNorm { d, .. } => Problem::RmsNorm { n: 1, d },
    }
}
