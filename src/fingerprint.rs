//! What decides the bits a process computes, as one comparable value: a rollout worker and a
//! trainer (two processes, often two hosts) compute the same log-probabilities exactly when
//! their fingerprints are equal. Covers the crate's version and sources, the kernels' sources,
//! and per float dtype the implementation the registry picks for each op on the device
//! (`BURN_INVARIANT_IMPL` included) with the device's architecture and the kernel variants its
//! capabilities select. Not covered: the inputs, and what a model does outside this crate.
use std::fmt;

use burn::tensor::DType;

use crate::InvariantBackend;
use crate::fnv;
use crate::registry::{Op, implementation_for};

/// See the module docs. `Display` prints a digest line, then one line per entry; compare two
/// fingerprints with `==` or by [`Fingerprint::digest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    entries: Vec<(String, String)>,
}

impl Fingerprint {
    /// `(name, value)` in a fixed order.
    pub fn entries(&self) -> &[(String, String)] {
        &self.entries
    }

    /// FNV-1a 64 of the entries, 16 hex digits: the same on every host for the same entries.
    pub fn digest(&self) -> String {
        let hash = self.entries.iter().fold(fnv::EMPTY, |hash, (name, value)| {
            fnv::fnv1a(
                hash,
                name.bytes().chain([0]).chain(value.bytes()).chain([0]),
            )
        });
        format!("{hash:016x}")
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "burn-invariant fingerprint {}", self.digest())?;
        for (name, value) in &self.entries {
            write!(f, "\n  {name}: {value}")?;
        }
        Ok(())
    }
}

/// The [`Fingerprint`] of calls on `device` with backend `B` in this process. `Autodiff` and
/// `Fusion` wrappers have their inner backend's (they compute the same bits).
pub fn fingerprint<B: InvariantBackend>(device: &B::Device) -> Fingerprint {
    let mut entries = vec![(
        "burn-invariant".to_string(),
        format!(
            "{} (sources {})",
            env!("CARGO_PKG_VERSION"),
            env!("BURN_INVARIANT_SOURCE_HASH")
        ),
    )];
    #[cfg(feature = "cubecl")]
    entries.push((
        "burn-invariant-cubecl".to_string(),
        format!("sources {}", burn_invariant_cubecl::SOURCE_HASH),
    ));
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let ops = [Op::Matmul, Op::LinearLogp, Op::Attention, Op::RmsNorm]
            .map(|op| match implementation_for::<B>(op, device, dtype) {
                Ok(implementation) => format!("{op:?} {implementation:?}"),
                Err(_) => format!("{op:?} none"),
            })
            .join(", ");
        entries.push((
            format!("{dtype:?}"),
            format!("{ops}; {}", B::invariant_kernel_choices(device, dtype)),
        ));
    }
    Fingerprint { entries }
}
