//! `InvariantBackend` for every `CubeBackend<R, F, I, BT>` (CUDA, wgpu, ROCm): the candidates
//! (`CubeCl`, and on CUDA `Sm90` for the ops with raw kernels, `super::sm90`), the CubeCL limits,
//! the tensor-parallel primitives, and what every op's `cube.rs` shares (launch results, error
//! mapping, 32-bit address fix-ups, kernel target dtypes). Outputs and workspaces are allocated
//! on the tensors' own client and stream, so the ops order with every other Burn op.
use burn::tensor::{
    DType,
    ops::{FloatTensor, IntTensor},
};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, kernel::into_contiguous,
    tensor::CubeTensor,
};
use burn_invariant_cubecl::{KernelError, attention, logp, rms_norm, tp as tp_kernels, util};
use cubecl::device::{Device as _, DeviceId};
use cubecl::prelude::ComputeClient;
use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex};

use super::alloc::empty;
#[cfg(feature = "cuda")]
use super::sm90;
use crate::InvariantError;
use crate::backend::{InvariantBackend, Problem};
use crate::registry::{Candidate, Implementation, Op};

/// Whether the CubeCL kernels can run `dtype` on this device.
pub(crate) fn cubecl_candidate<R: CubeRuntime>(device: &R::Device, dtype: DType) -> Candidate {
    let client = R::client(device);
    let storage = match dtype {
        DType::F32 | DType::F16 | DType::BF16 => dtype.into(),
        other => {
            return Candidate::unavailable(
                Implementation::CubeCl,
                format!("the CubeCL kernels take F32, F16 or BF16, got {other:?}"),
            );
        }
    };
    if util::runtime_supports(&client, storage) {
        Candidate::available(Implementation::CubeCl)
    } else {
        Candidate::unavailable(
            Implementation::CubeCl,
            format!(
                "runtime `{}` does not support {dtype:?} on this device",
                R::name(&client)
            ),
        )
    }
}

/// Targets as the kernels take them: i32 or i64. Other integer dtypes are converted once, to
/// i64 where the runtime has it, so every value keeps its meaning (an unsigned value past
/// `i64::MAX` becomes negative: out of range, never another class). A runtime without i64 holds
/// no 64-bit targets, and an unsigned 32-bit value past `i32::MAX` turns negative: out of range.
pub(crate) fn index_targets<R: CubeRuntime>(targets: CubeTensor<R>) -> CubeTensor<R> {
    use burn::tensor::{IntDType, ops::IntTensorOps};
    if matches!(targets.dtype, DType::I32 | DType::I64) {
        return targets;
    }
    let wide = util::runtime_supports(&targets.client, DType::I64.into());
    let dtype = if wide { IntDType::I64 } else { IntDType::I32 };
    CubeBackend::<R, f32, i32, u8>::int_cast(targets, dtype)
}

/// Devices on which a launch failed, with the runtime's message, for good; `ANY_FAILED` lets
/// every call skip the lock while none has.
static FAILED_DEVICES: Mutex<Vec<(DeviceId, String)>> = Mutex::new(Vec::new());
static ANY_FAILED: AtomicBool = AtomicBool::new(false);

/// [`launch_class`] rows: none, or the first dimension.
pub(crate) const NO_ROWS: &[usize] = &[];
pub(crate) const ROWS_FIRST: &[usize] = &[0];

/// The launch classes already settled, per device.
static SETTLED: LazyLock<Mutex<HashSet<(DeviceId, u64)>>> = LazyLock::new(Mutex::default);

/// What of a primitive call can pick a kernel variant, so that two calls of one class launch the
/// same compiled kernels: the primitive and its switches, each operand's dtype, every dimension
/// except the ones that count rows (given per operand; they enter as their next power of two,
/// since the kernels only compare them against powers of two), and its layout (which strides
/// are 1, which are multiples of 8 elements, its offset modulo 16 bytes: what the vector widths
/// read). Hashed in this process, with no allocation: computed on every call.
pub(crate) fn launch_class<R: CubeRuntime>(
    switches: impl Hash,
    operands: &[(&CubeTensor<R>, &[usize])],
) -> u64 {
    let mut hasher = DefaultHasher::new();
    switches.hash(&mut hasher);
    for (t, rows) in operands {
        t.dtype.hash(&mut hasher);
        let (shape, strides) = (t.meta.shape(), t.meta.strides());
        shape.len().hash(&mut hasher);
        for (i, &d) in shape.iter().enumerate() {
            let d = if rows.contains(&i) {
                d.next_power_of_two()
            } else {
                d
            };
            d.hash(&mut hasher);
        }
        for &st in strides.iter() {
            (st == 1, st % 8 == 0).hash(&mut hasher);
        }
        (t.handle.offset_start.unwrap_or(0) % 16).hash(&mut hasher);
    }
    hasher.finish()
}

/// After a primitive's launches, the first time their class runs on `device`: cubecl reports a
/// kernel its compiler rejected (or a launch the driver refused) only at the next flush or read,
/// so flush (a blocking round trip to cubecl's device thread, which a decode step would pay on
/// every call) and, on failure, mark `device` failed, so that the failed call (where it ran
/// before returning) and every later call there return [`InvariantError::DeviceFailed`] instead
/// of results nothing wrote. Kernels are compiled at the first launch of their variant, and a
/// class fixes the variants.
pub(crate) fn settle_launches<R: CubeRuntime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    class: u64,
) {
    let first = SETTLED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert((device.to_id(), class));
    if !first {
        return;
    }
    if let Err(err) = client.flush() {
        log::error!("burn-invariant: a launch on {device:?} failed: {err:?}");
        let mut failed = FAILED_DEVICES.lock().unwrap_or_else(|e| e.into_inner());
        if !failed.iter().any(|(d, _)| *d == device.to_id()) {
            failed.push((device.to_id(), format!("{err:?}")));
        }
        ANY_FAILED.store(true, Ordering::Release);
    }
}

/// The failure [`settle_launches`] recorded for `device`, if any.
pub(crate) fn device_failure<R: CubeRuntime>(device: &R::Device) -> Option<InvariantError> {
    if !ANY_FAILED.load(Ordering::Acquire) {
        return None;
    }
    FAILED_DEVICES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(d, _)| *d == device.to_id())
        .map(|(_, reason)| InvariantError::DeviceFailed {
            device: format!("{device:?}"),
            reason: reason.clone(),
        })
}

/// Kernel launches only fail on inputs the public API has already rejected: dtypes and shapes
/// (each op's `api.rs`), sizes (`cubecl_limits` through `check_problem`), 32-bit addressing
/// (`addressable`), grids (the kernels split launches to the runtime's cube count). A failure
/// here is a bug.
pub(crate) fn launched<T>(result: Result<T, KernelError>) -> T {
    result.unwrap_or_else(|err| panic!("burn-invariant: a validated launch was refused: {err}"))
}

/// The CubeCl limits of a problem on `device`, checked before anything runs: the `linear_logp`
/// backward's workspace and grids (a forward may be differentiated later, where no error can be
/// returned). Every other size runs, in as many launches as it needs.
fn cubecl_limits<R: CubeRuntime>(
    device: &R::Device,
    dtype: DType,
    problem: Problem,
) -> Result<(), InvariantError> {
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Ok(());
    }
    let client = R::client(device);
    let checked = match problem {
        Problem::Matmul { .. } => return Ok(()),
        Problem::LinearLogp { n, d, v } => {
            logp::linear_logp_limits(&client, [n, d, v], dtype.into(), true)
        }
        Problem::Attention {
            batch,
            heads,
            kv_heads,
            q_len,
            kv_len,
            head_dim,
        } => attention::attention_limits(
            &client,
            attention::AttentionDims {
                batch,
                heads,
                kv_heads,
                q_len,
                kv_len,
                head_dim,
            },
        ),
        Problem::RmsNorm { n, d } => rms_norm::rms_norm_limits(&client, n, d),
    };
    checked.map_err(|err| kernel_limit(err, problem))
}

/// A kernel's refusal of a problem as the caller's error.
pub(crate) fn kernel_limit(err: KernelError, problem: Problem) -> InvariantError {
    let too_large = |arg, what, got: u128, limit: u128| InvariantError::TooLarge {
        arg,
        what,
        got: got.min(u64::MAX as u128) as u64,
        limit: limit.min(u64::MAX as u128) as u64,
    };
    match err {
        KernelError::IndexOverflow {
            arg,
            what,
            value,
            limit,
        } => too_large(arg, what, value, limit),
        KernelError::GridTooLarge {
            arg,
            what,
            value,
            limit,
        } => too_large(arg, what, value.into(), limit.into()),
        other => InvariantError::UnsupportedProblem {
            implementation: Implementation::CubeCl,
            problem,
            reason: other.to_string(),
        },
    }
}

/// `t`, copied to a contiguous buffer where its buffer or the span its strides address passes
/// the kernels' 32-bit offsets (a column slice of a wide tensor); its own element count fits
/// (each op's `api.rs` checks it), so the copy does.
pub(crate) fn addressable<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    let limit = burn_invariant_cubecl::consts::MAX_INDEX;
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    let span = if shape.contains(&0) {
        0
    } else {
        shape
            .iter()
            .zip(strides.iter())
            .map(|(&s, &st)| (s as u128 - 1) * st as u128)
            .sum::<u128>()
    };
    let buffer = t.handle.size_in_used() as u128 / t.dtype.size() as u128;
    if span <= limit && buffer <= limit + 1 {
        t
    } else if t.is_contiguous() {
        // Contiguous, but in a larger buffer than its elements: a copy of just them.
        t.copy()
    } else {
        into_contiguous(t)
    }
}

/// The candidates of an op with raw SM90 kernels: Sm90 first where it can run; otherwise it
/// stays listed after CubeCl so forcing it explains why not.
fn with_sm90<R: CubeRuntime>(
    cubecl: Candidate,
    device: &R::Device,
    dtype: DType,
) -> Vec<Candidate> {
    #[cfg(feature = "cuda")]
    let sm90 = sm90::candidate::<R>(device, dtype);
    #[cfg(not(feature = "cuda"))]
    let sm90 = {
        let _ = (device, dtype);
        Candidate::unavailable(
            Implementation::Sm90,
            "needs a CUDA device and the `cuda` feature of burn-invariant",
        )
    };
    if sm90.availability.is_ok() || sm90.required {
        vec![sm90, cubecl]
    } else {
        vec![cubecl, sm90]
    }
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> InvariantBackend
    for CubeBackend<R, F, I, BT>
{
    fn implementations(op: Op, device: &Self::Device, dtype: DType) -> Vec<Candidate> {
        let cubecl = cubecl_candidate::<R>(device, dtype);
        match op {
            Op::Matmul | Op::LinearLogp | Op::Attention => with_sm90::<R>(cubecl, device, dtype),
            // No raw SM90 kernels for RMSNorm (memory-bound): Hopper runs the CubeCL ones.
            Op::RmsNorm => vec![
                cubecl,
                Candidate::unavailable(
                    Implementation::Sm90,
                    format!("{op:?} has no Sm90 kernels; it runs on CubeCl on every CUDA device"),
                ),
            ],
        }
    }

    fn check_problem(
        implementation: Implementation,
        device: &Self::Device,
        dtype: DType,
        problem: Problem,
    ) -> Result<(), InvariantError> {
        match implementation {
            #[cfg(feature = "cuda")]
            Implementation::Sm90 => {
                sm90::check_problem(problem).map_err(|reason| InvariantError::UnsupportedProblem {
                    implementation,
                    problem,
                    reason,
                })
            }
            _ => cubecl_limits::<R>(device, dtype, problem),
        }
    }

    fn invariant_device_failure(device: &Self::Device) -> Option<InvariantError> {
        device_failure::<R>(device)
    }

    fn invariant_kernel_choices(device: &Self::Device, dtype: DType) -> String {
        let client = R::client(device);
        #[cfg(feature = "cuda")]
        let arch = match sm90::device_capability::<R>(device) {
            Some(cc) => format!(" sm_{cc}"),
            None => String::new(),
        };
        #[cfg(not(feature = "cuda"))]
        let arch = String::new();
        let choices = match burn_invariant_cubecl::FloatDType::from_storage("dtype", dtype.into()) {
            Ok(dt) if util::runtime_supports(&client, dtype.into()) => {
                burn_invariant_cubecl::kernel_choices(&client, dt)
            }
            _ => format!("{dtype:?} not supported"),
        };
        format!("{}{arch}; {choices}", R::name(&client))
    }

    fn invariant_tp_leaf_targets(
        targets: IntTensor<Self>,
        start: usize,
        end: usize,
        ignore_index: Option<i64>,
    ) -> IntTensor<Self> {
        let targets = into_contiguous(index_targets(targets));
        let out = empty(&targets, targets.meta.shape().to_vec(), targets.dtype);
        let class = launch_class(
            ("tp_leaf_targets", ignore_index.is_some()),
            &[(&targets, ROWS_FIRST)],
        );
        launched(tp_kernels::leaf_targets(
            &targets.client,
            &targets.clone().binding(),
            &out.clone().binding(),
            targets.dtype.into(),
            start,
            end,
            ignore_index,
        ));
        settle_launches(&targets.client, &targets.device, class);
        out
    }

    fn invariant_tp_merge_lse(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        merge(a, b, "tp_merge_lse", tp_kernels::merge_lse)
    }

    fn invariant_tp_merge_entropy(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        merge(a, b, "tp_merge_entropy", tp_kernels::merge_entropy)
    }

    fn invariant_tp_pick(
        acc: Option<FloatTensor<Self>>,
        stats: FloatTensor<Self>,
        leaf_targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let (stats, leaf_targets) = (
            into_contiguous(stats),
            into_contiguous(index_targets(leaf_targets)),
        );
        let acc = acc.map(into_contiguous);
        let n = leaf_targets.meta.shape()[0];
        let out = empty(&stats, vec![2, n], DType::F32);
        let class = launch_class(
            ("tp_pick", acc.is_some()),
            &[(&stats, ROWS_FIRST), (&leaf_targets, ROWS_FIRST)],
        );
        let acc_binding = acc.map(|a| a.binding());
        launched(tp_kernels::pick(
            &stats.client,
            acc_binding.as_ref(),
            &stats.clone().binding(),
            &leaf_targets.clone().binding(),
            leaf_targets.dtype.into(),
            &out.clone().binding(),
        ));
        settle_launches(&stats.client, &stats.device, class);
        out
    }

    fn invariant_tp_finish(
        picks: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        targets: IntTensor<Self>,
        vocab: usize,
        ignore_index: Option<i64>,
    ) -> FloatTensor<Self> {
        let (picks, lse, targets) = (
            into_contiguous(picks),
            into_contiguous(lse),
            into_contiguous(index_targets(targets)),
        );
        let n = targets.meta.shape()[0];
        let out = empty(&lse, vec![n, 2], DType::F32);
        let class = launch_class(
            ("tp_finish", ignore_index.is_some()),
            &[(&lse, ROWS_FIRST), (&targets, ROWS_FIRST)],
        );
        let targets_binding = targets.clone().binding();
        let global = tp_kernels::GlobalTargets {
            targets: &targets_binding,
            dtype: targets.dtype.into(),
            vocab,
            ignore_index,
        };
        launched(tp_kernels::finish(
            &lse.client,
            &picks.binding(),
            &lse.clone().binding(),
            &global,
            &out.clone().binding(),
        ));
        settle_launches(&lse.client, &lse.device, class);
        out
    }
}

/// A tensor-parallel merge kernel's `out = a ⊕ b` over contiguous f32 operands of `a`'s shape.
fn merge<R: CubeRuntime>(
    a: CubeTensor<R>,
    b: CubeTensor<R>,
    primitive: &'static str,
    launch: MergeLaunch<R>,
) -> CubeTensor<R> {
    let (a, b) = (into_contiguous(a), into_contiguous(b));
    let out = empty(&a, a.meta.shape().to_vec(), DType::F32);
    let class = launch_class(primitive, &[(&a, &[0, 1][..])]);
    launched(launch(
        &a.client,
        &a.clone().binding(),
        &b.binding(),
        &out.clone().binding(),
    ));
    settle_launches(&a.client, &a.device, class);
    out
}

/// The signature of `tp_kernels::merge_lse` and `tp_kernels::merge_entropy`.
type MergeLaunch<R> = fn(
    &cubecl::prelude::ComputeClient<R>,
    &cubecl::prelude::TensorBinding<R>,
    &cubecl::prelude::TensorBinding<R>,
    &cubecl::prelude::TensorBinding<R>,
) -> Result<(), KernelError>;
