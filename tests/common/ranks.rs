//! Rank threads for the tensor-parallel tests (CPU and NCCL).
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

/// Runs `f(rank, handle)` on one thread per handle; results in rank order. A rank that panics
/// fails the test with its message; one that hangs fails it after `watchdog`.
pub fn on_ranks<G: Send + 'static, T: Send + 'static>(
    handles: Vec<G>,
    watchdog: Duration,
    f: impl Fn(usize, G) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let world = handles.len();
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for (rank, handle) in handles.into_iter().enumerate() {
        let (f, tx) = (f.clone(), tx.clone());
        std::thread::spawn(move || {
            let out = catch_unwind(AssertUnwindSafe(|| f(rank, handle)));
            let _ = tx.send((rank, out.map_err(|e| panic_message(&e))));
        });
    }
    let deadline = Instant::now() + watchdog;
    let mut results: Vec<Option<T>> = (0..world).map(|_| None).collect();
    for _ in 0..world {
        let left = deadline.saturating_duration_since(Instant::now());
        let (rank, out) = rx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("watchdog: a rank did not finish within {watchdog:?}"));
        results[rank] = Some(out.unwrap_or_else(|msg| panic!("rank {rank} panicked: {msg}")));
    }
    results.into_iter().map(Option::unwrap).collect()
}

pub fn panic_message(e: &Box<dyn std::any::Any + Send>) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Bit patterns of host f32 values, for [`super::assert_bits_eq`].
pub fn bits_of(v: &[f32]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits() as u64).collect()
}
