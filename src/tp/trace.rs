//! Phase timings for profiling the tensor-parallel engine: `log` records at level `trace` for
//! the target [`TARGET`] (e.g. `RUST_LOG=burn_invariant::tp::trace=trace` with `env_logger`).
//! Each phase then waits for the device, so the timings show costs, not the overlapped total;
//! when the target is off nothing waits.
use burn::tensor::backend::Backend;

/// The `log` target of the phase timings.
pub(crate) const TARGET: &str = "burn_invariant::tp::trace";

/// Each mark waits for the device and records the time since the previous mark.
pub(crate) struct Trace<'a, B: Backend> {
    device: &'a B::Device,
    last: Option<std::time::Instant>,
}

impl<'a, B: Backend> Trace<'a, B> {
    pub(crate) fn start(device: &'a B::Device) -> Self {
        let mut trace = Self { device, last: None };
        if log::log_enabled!(target: TARGET, log::Level::Trace) {
            let _ = B::sync(device);
            trace.last = Some(std::time::Instant::now());
        }
        trace
    }

    pub(crate) fn mark(&mut self, phase: &str) {
        if let Some(last) = self.last {
            let _ = B::sync(self.device);
            let now = std::time::Instant::now();
            log::trace!(target: TARGET, "{phase}: {:.3} ms", (now - last).as_secs_f64() * 1e3);
            self.last = Some(now);
        }
    }
}
