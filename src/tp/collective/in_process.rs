//! An in-process [`Collective`]: one thread per rank, a mutex and a condition variable.
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Tensor, TensorData, backend::Backend};

use super::Collective;
use crate::InvariantError;

/// How long [`InProcessGroup::new`] handles wait for the other ranks.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// One rank's handle of a group whose ranks are threads of this process.
///
/// **A test and single-host helper**: blocks travel through host memory (`into_data` /
/// `from_data`), so it works for every backend (NdArray, Wgpu, Cuda) but costs two host copies
/// per exchange. Multi-GPU CUDA runs want an NCCL group.
///
/// Every wait is bounded by the group's timeout: when a rank does not arrive in time, the
/// waiting ranks return [`InvariantError::Collective`] naming the missing ranks, and the group
/// is broken for good: every later call on any rank returns that same error at once
/// ([`Collective::fail`] breaks it the same way). Exchanges complete before they return, so
/// [`Collective::settle`] has nothing to wait for. Cloning a
/// handle gives another handle of the same rank (for the autodiff backward); two threads must
/// not use one rank at the same time.
#[derive(Clone)]
pub struct InProcessGroup {
    rank: usize,
    shared: Arc<Shared>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    arrived: Condvar,
}

#[derive(Debug, Clone)]
enum Payload {
    Host(Vec<u64>),
    Float(Vec<f32>),
}

impl Payload {
    fn describe(&self) -> String {
        match self {
            Payload::Host(v) => format!("a host block of {} words", v.len()),
            Payload::Float(v) => format!("an f32 block of {} values", v.len()),
        }
    }

    fn same_kind(&self, other: &Self) -> bool {
        match (self, other) {
            (Payload::Host(a), Payload::Host(b)) => a.len() == b.len(),
            (Payload::Float(a), Payload::Float(b)) => a.len() == b.len(),
            _ => false,
        }
    }
}

struct State {
    generation: u64,
    slots: Vec<Option<Payload>>,
    arrived: usize,
    /// The blocks of the last completed generation: a waiter of generation g reads them before
    /// generation g + 1 can complete (which needs that waiter).
    result: Arc<Vec<Payload>>,
    broken: Option<InvariantError>,
}

impl core::fmt::Debug for InProcessGroup {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("InProcessGroup")
            .field("rank", &self.rank)
            .field("world", &self.shared.world)
            .field("timeout", &self.shared.timeout)
            .finish()
    }
}

impl InProcessGroup {
    /// `world` handles, one per rank (index = rank), waiting at most [`DEFAULT_TIMEOUT`].
    pub fn new(world: usize) -> Vec<Self> {
        Self::with_timeout(world, DEFAULT_TIMEOUT)
    }

    /// `world` handles (none for 0) whose waits give up after `timeout` (at most
    /// [`super::LONGEST_TIMEOUT`]).
    pub fn with_timeout(world: usize, timeout: Duration) -> Vec<Self> {
        let shared = Arc::new(Shared {
            world,
            timeout: timeout.min(super::LONGEST_TIMEOUT),
            state: Mutex::new(State {
                generation: 0,
                slots: vec![None; world],
                arrived: 0,
                result: Arc::new(Vec::new()),
                broken: None,
            }),
            arrived: Condvar::new(),
        });
        (0..world)
            .map(|rank| Self {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover the data if a caller's thread did.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Deposits this rank's block and returns every rank's, or the group's error.
    fn exchange(&self, payload: Payload) -> Result<Arc<Vec<Payload>>, InvariantError> {
        let shared = &self.shared;
        let mut state = self.lock();
        if let Some(error) = &state.broken {
            return Err(error.clone());
        }
        if state.slots[self.rank].is_some() {
            let error = InvariantError::Collective {
                reason: format!(
                    "rank {} entered a collective twice at once (one handle used by two threads)",
                    self.rank
                ),
            };
            state.broken = Some(error.clone());
            shared.arrived.notify_all();
            return Err(error);
        }
        state.slots[self.rank] = Some(payload);
        state.arrived += 1;
        if state.arrived == shared.world {
            let blocks: Vec<Payload> = state.slots.iter_mut().filter_map(Option::take).collect();
            state.result = Arc::new(blocks);
            state.arrived = 0;
            state.generation += 1;
            shared.arrived.notify_all();
            return Ok(state.result.clone());
        }
        let generation = state.generation;
        let deadline = Instant::now() + shared.timeout;
        loop {
            if let Some(error) = &state.broken {
                return Err(error.clone());
            }
            if state.generation != generation {
                return Ok(state.result.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..shared.world)
                    .filter(|&r| state.slots[r].is_none())
                    .collect();
                let error = InvariantError::Collective {
                    reason: format!(
                        "in-process group of {} ranks: timed out after {:?} waiting for rank(s) {missing:?}",
                        shared.world, shared.timeout
                    ),
                };
                state.broken = Some(error.clone());
                shared.arrived.notify_all();
                return Err(error);
            }
            state = shared
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }

    /// Every rank checks the same blocks, so every rank reaches the same verdict.
    fn checked(blocks: &[Payload]) -> Result<(), InvariantError> {
        let first = &blocks[0];
        match blocks.iter().position(|b| !b.same_kind(first)) {
            None => Ok(()),
            Some(rank) => Err(InvariantError::Collective {
                reason: format!(
                    "all-gather blocks differ: rank 0 passed {}, rank {rank} passed {}",
                    first.describe(),
                    blocks[rank].describe()
                ),
            }),
        }
    }
}

impl<B: Backend> Collective<B> for InProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_gather_host(&self, block: &[u64]) -> Result<Vec<u64>, InvariantError> {
        let blocks = self.exchange(Payload::Host(block.to_vec()))?;
        Self::checked(&blocks)?;
        Ok(blocks
            .iter()
            .flat_map(|b| match b {
                Payload::Host(v) => v.as_slice(),
                Payload::Float(_) => &[],
            })
            .copied()
            .collect())
    }

    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, InvariantError> {
        let device = block.device();
        let data = block
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| InvariantError::Read {
                arg: "all-gather block",
                reason: format!("{e:?}"),
            });
        // A rank that cannot read its block still takes part, so the others do not wait.
        let (payload, local_error) = match data {
            Ok(values) => (Payload::Float(values), None),
            Err(error) => (Payload::Host(Vec::new()), Some(error)),
        };
        let blocks = self.exchange(payload)?;
        if let Some(error) = local_error {
            return Err(error);
        }
        Self::checked(&blocks)?;
        let values: Vec<f32> = blocks
            .iter()
            .flat_map(|b| match b {
                Payload::Float(v) => v.as_slice(),
                Payload::Host(_) => &[],
            })
            .copied()
            .collect();
        let len = values.len();
        Ok(Tensor::from_data(
            TensorData::new(values, [len]),
            (&device, DType::F32),
        ))
    }

    /// Breaks the group (the first error stays) and wakes the ranks waiting in an exchange,
    /// which return it at once.
    fn fail(&self, error: InvariantError) {
        let mut state = self.lock();
        state.broken.get_or_insert(error);
        self.shared.arrived.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type B = burn_ndarray::NdArray<f32>;

    fn on_threads<T: Send + 'static>(
        groups: Vec<InProcessGroup>,
        f: impl Fn(InProcessGroup) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let f = f.clone();
                std::thread::spawn(move || f(g))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn gathers_in_rank_order_repeatedly() {
        let out = on_threads(InProcessGroup::new(3), |g| {
            let r = Collective::<B>::rank(&g) as u64;
            (0..50)
                .map(|round| Collective::<B>::all_gather_host(&g, &[r, round]).unwrap())
                .collect::<Vec<_>>()
        });
        for per_rank in out {
            for (round, v) in per_rank.into_iter().enumerate() {
                let round = round as u64;
                assert_eq!(v, vec![0, round, 1, round, 2, round]);
            }
        }
    }

    #[test]
    fn float_blocks_keep_their_bits() {
        let out = on_threads(InProcessGroup::new(2), |g| {
            let r = Collective::<B>::rank(&g);
            let values = vec![f32::from_bits(0x8000_0000 | r as u32), f32::NAN, -0.0];
            let t = Tensor::<B, 1>::from_data(TensorData::new(values, [3]), &Default::default());
            let all = g.all_gather(t).unwrap();
            all.into_data()
                .iter::<f32>()
                .map(f32::to_bits)
                .collect::<Vec<_>>()
        });
        let nan = f32::NAN.to_bits();
        let neg0 = (-0.0f32).to_bits();
        let expected = vec![0x8000_0000, nan, neg0, 0x8000_0001, nan, neg0];
        assert_eq!(out, vec![expected.clone(), expected]);
    }

    #[test]
    fn different_lengths_fail_on_every_rank() {
        let out = on_threads(InProcessGroup::new(2), |g| {
            let r = Collective::<B>::rank(&g);
            Collective::<B>::all_gather_host(&g, &vec![0; 1 + r]).unwrap_err()
        });
        assert_eq!(out[0], out[1]);
        assert!(matches!(out[0], InvariantError::Collective { .. }));
    }

    #[test]
    fn a_missing_rank_times_out_and_breaks_the_group() {
        let mut groups = InProcessGroup::with_timeout(3, Duration::from_millis(200));
        let late = groups.pop().unwrap();
        let start = Instant::now();
        let errors = on_threads(groups, |g| {
            Collective::<B>::all_gather_host(&g, &[1]).unwrap_err()
        });
        assert!(start.elapsed() < Duration::from_secs(10));
        assert_eq!(errors[0], errors[1]);
        assert!(format!("{}", errors[0]).contains("[2]"), "{}", errors[0]);
        assert_eq!(
            Collective::<B>::all_gather_host(&late, &[1]).unwrap_err(),
            errors[0]
        );
    }
}
