//! FNV-1a 64, for hashes two hosts compare: its value is fixed by its definition, whatever the
//! compiler version (std's hashers are not). Shared by `build.rs` (the source hash, through
//! `#[path]`) and [`crate::fingerprint`].

/// The hash of no bytes.
pub(crate) const EMPTY: u64 = 0xcbf2_9ce4_8422_2325;

/// `hash` continued over `bytes`.
pub(crate) fn fnv1a(hash: u64, bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes
        .into_iter()
        .fold(hash, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}
