//! Phase timings for profiling the tensor-parallel engine (`BURN_INVARIANT_TP_TRACE=1`).
use burn::tensor::backend::Backend;

/// Each mark waits for the device and prints the time since the previous mark. The variable
/// is read once per process.
pub(crate) struct Trace<'a, B: Backend> {
    device: &'a B::Device,
    last: Option<std::time::Instant>,
}

impl<'a, B: Backend> Trace<'a, B> {
    pub(crate) fn start(device: &'a B::Device) -> Self {
        static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let enabled = *ENABLED
            .get_or_init(|| std::env::var("BURN_INVARIANT_TP_TRACE").is_ok_and(|v| v == "1"));
        let mut trace = Self { device, last: None };
        if enabled {
            let _ = B::sync(device);
            trace.last = Some(std::time::Instant::now());
        }
        trace
    }

    pub(crate) fn mark(&mut self, phase: &str) {
        if let Some(last) = self.last {
            let _ = B::sync(self.device);
            let now = std::time::Instant::now();
            eprintln!(
                "tp-trace {phase}: {:.3} ms",
                (now - last).as_secs_f64() * 1e3
            );
            self.last = Some(now);
        }
    }
}
