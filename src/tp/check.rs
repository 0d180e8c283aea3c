//! Collective validation: every rank checks its own inputs, the ranks exchange one small host
//! table, and every rank derives the same verdict from the same table.
use burn::tensor::{DType, Int, Tensor};

use super::{Plan, VocabShard};
use crate::backend::Collective;
use crate::ops::linear_logp::api::check_linear_logp;
use crate::registry::Implementation;
use crate::{InvariantBackend, InvariantError, LinearLogpOptions};

const RANK: usize = 0;
const WORLD: usize = 1;
const FAILED: usize = 2;
const START: usize = 3;
const END: usize = 4;
const VOCAB: usize = 5;
const ROWS: usize = 6;
const HIDDEN: usize = 7;
const DTYPE: usize = 8;
const BIAS: usize = 9;
const IGNORE_SET: usize = 10;
const IGNORE: usize = 11;
const SKIP: usize = 12;
const HASH: usize = 13;
const BAD_COUNT: usize = 14;
const BAD_INDEX: usize = 15;
const BAD_VALUE: usize = 16;
const GRAD: usize = 17;
const IMPL: usize = 18;
const TEMPERATURE: usize = 19;
const ENTROPY: usize = 20;
const EXTRA: usize = 21;
const MSG_LEN: usize = 22;
const MSG: usize = 23;
/// A failing rank's message travels in this many bytes (truncated on a char boundary).
const MSG_BYTES: usize = 512;
const WORDS: usize = MSG + MSG_BYTES / 8;

fn dtype_code(dtype: DType) -> u64 {
    match dtype {
        DType::F64 => 1,
        DType::F32 => 2,
        DType::F16 => 3,
        DType::BF16 => 4,
        _ => 0,
    }
}

fn dtype_name(code: u64) -> &'static str {
    ["other", "F64", "F32", "F16", "BF16"]
        .get(code as usize)
        .copied()
        .unwrap_or("other")
}

fn implementation_code(implementation: Implementation) -> u64 {
    match implementation {
        Implementation::Reference => 1,
        Implementation::CubeCl => 2,
        Implementation::Sm90 => 3,
    }
}

fn implementation_name(code: u64) -> &'static str {
    ["none", "Reference", "CubeCl", "Sm90"]
        .get(code as usize)
        .copied()
        .unwrap_or("none")
}

/// FNV-1a over the targets: ranks holding different targets are caught with overwhelming
/// probability, at no extra host read.
pub(crate) fn fnv1a(values: impl Iterator<Item = i64>) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for value in values {
        for byte in value.to_le_bytes() {
            hash ^= byte as u64;
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash
}

/// The tensors of one rank, by reference.
pub(crate) struct RankInputs<'a, B: InvariantBackend> {
    pub hidden: &'a Tensor<B, 2>,
    pub weight: &'a Tensor<B, 2>,
    pub targets: &'a Tensor<B, 1, Int>,
    pub bias: Option<&'a Tensor<B, 1>>,
    pub shard: &'a VocabShard,
    pub options: &'a LinearLogpOptions,
    /// Whether this call computes the entropy (`tp::linear_logp_full` with it requested).
    pub entropy: bool,
    /// A caller's own local check: its error fails this rank, its value (a hash of what every
    /// rank must hold alike, e.g. `tp::linear_sample`'s keys and options) must agree.
    pub extra: Option<&'a Result<u64, InvariantError>>,
}

/// This rank's checks, writing the table row; `Err` is this rank's own failure.
/// `group_device` is where the group exchanges this rank's blocks, when it is bound to one.
fn local<B: InvariantBackend>(
    inputs: &RankInputs<'_, B>,
    group_device: Option<B::Device>,
    row: &mut [u64],
) -> Result<Implementation, InvariantError> {
    let RankInputs {
        hidden,
        weight,
        targets,
        bias,
        shard,
        options,
        entropy,
        extra,
    } = inputs;
    match extra {
        Some(Err(error)) => return Err(error.clone()),
        Some(Ok(value)) => row[EXTRA] = *value,
        None => {}
    }
    let ([n, d], [v_local, _]) = (hidden.dims(), weight.dims());
    row[START] = shard.start as u64;
    row[END] = shard.end as u64;
    row[VOCAB] = shard.global_vocab as u64;
    row[ROWS] = n as u64;
    row[HIDDEN] = d as u64;
    row[DTYPE] = dtype_code(hidden.dtype());
    row[BIAS] = bias.is_some() as u64;
    row[IGNORE_SET] = options.ignore_index.is_some() as u64;
    row[IGNORE] = options.ignore_index.unwrap_or(0) as u64;
    row[SKIP] = options.skip_target_check as u64;
    row[TEMPERATURE] = options.temperature.to_bits();
    row[ENTROPY] = *entropy as u64;
    row[GRAD] = hidden.is_require_grad() as u64;
    if shard.start >= shard.end || shard.end > shard.global_vocab {
        return Err(InvariantError::Partition {
            rank: row[RANK] as usize,
            expected: format!(
                "a non-empty range start < end ≤ global_vocab = {}",
                shard.global_vocab
            ),
            got: format!("[{}, {})", shard.start, shard.end),
        });
    }
    if v_local != shard.len() {
        return Err(InvariantError::Shape {
            arg: "weight",
            expected: format!(
                "dimension 0 = {} (the shard [{}, {}))",
                shard.len(),
                shard.start,
                shard.end
            ),
            got: weight.dims().to_vec(),
        });
    }
    let local_options = LinearLogpOptions {
        skip_target_check: true,
        ..(*options).clone()
    };
    let implementation = check_linear_logp(hidden, weight, targets, *bias, &local_options)?;
    // Every tensor is on hidden's device (checked above).
    if let Some(expected) = group_device.filter(|device| *device != hidden.device()) {
        return Err(InvariantError::DeviceMismatch {
            arg: "hidden",
            reference: "group",
            expected: format!("{expected:?}"),
            got: format!("{:?}", hidden.device()),
        });
    }
    row[IMPL] = implementation_code(implementation);
    if !options.skip_target_check {
        // The one host read of the targets: the global range check and the hash.
        let data = crate::validate::host_data((*targets).clone(), "targets")?;
        let values: Vec<i64> = data.iter::<i64>().collect();
        row[HASH] = fnv1a(values.iter().copied());
        let vocab = shard.global_vocab as u64;
        let bad = |t: i64| !(t >= 0 && (t as u64) < vocab) && Some(t) != options.ignore_index;
        let mut count = 0u64;
        for (index, &t) in values.iter().enumerate() {
            if bad(t) {
                if count == 0 {
                    row[BAD_INDEX] = index as u64;
                    row[BAD_VALUE] = t as u64;
                }
                count += 1;
            }
        }
        row[BAD_COUNT] = count;
    }
    Ok(implementation)
}

fn write_message(row: &mut [u64], message: &str) {
    let mut end = message.len().min(MSG_BYTES);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let bytes = &message.as_bytes()[..end];
    row[MSG_LEN] = bytes.len() as u64;
    for (word, chunk) in row[MSG..].iter_mut().zip(bytes.chunks(8)) {
        let mut buf = [0u8; 8];
        buf[..chunk.len()].copy_from_slice(chunk);
        *word = u64::from_le_bytes(buf);
    }
}

fn read_message(row: &[u64]) -> String {
    let len = (row[MSG_LEN] as usize).min(MSG_BYTES);
    let bytes: Vec<u8> = row[MSG..]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .take(len)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The verdict of the gathered table: a pure function of it, so every rank agrees.
fn verdict(table: &[&[u64]]) -> Result<Vec<(usize, usize)>, InvariantError> {
    check_membership(table)?;
    check_agreement(table)?;
    check_partition(table)?;
    if table[0][SKIP] == 0 {
        check_targets(table)?;
    }
    Ok(table
        .iter()
        .map(|row| (row[START] as usize, row[END] as usize))
        .collect())
}

/// Every slot holds the rank it is for, of this world, and no rank failed its local checks.
fn check_membership(table: &[&[u64]]) -> Result<(), InvariantError> {
    let world = table.len();
    for (rank, row) in table.iter().enumerate() {
        if row[RANK] as usize != rank || row[WORLD] as usize != world {
            return Err(InvariantError::Collective {
                reason: format!(
                    "the handle in slot {rank} reports rank {} of world {}, the group has {world} ranks",
                    row[RANK], row[WORLD]
                ),
            });
        }
    }
    match table.iter().position(|row| row[FAILED] != 0) {
        Some(rank) => Err(InvariantError::RankFailed {
            rank,
            world,
            reason: read_message(table[rank]),
        }),
        None => Ok(()),
    }
}

type Render = Box<dyn Fn(&[u64]) -> String>;

/// The fields every rank must agree on: what, the words that hold it, how to show it.
fn agreed_fields() -> [(&'static str, &'static [usize], Render); 12] {
    let plain = |w: usize| move |row: &[u64]| row[w].to_string();
    let flag = |w: usize| move |row: &[u64]| (row[w] != 0).to_string();
    [
        (
            "V_global (`shard.global_vocab`)",
            &[VOCAB],
            Box::new(plain(VOCAB)),
        ),
        (
            "N (rows of `hidden` and `targets`)",
            &[ROWS],
            Box::new(plain(ROWS)),
        ),
        (
            "D (columns of `hidden`)",
            &[HIDDEN],
            Box::new(plain(HIDDEN)),
        ),
        (
            "the dtype of `hidden`",
            &[DTYPE],
            Box::new(|row: &[u64]| dtype_name(row[DTYPE]).to_string()),
        ),
        ("whether `bias` is given", &[BIAS], Box::new(flag(BIAS))),
        (
            "`options.ignore_index`",
            &[IGNORE_SET, IGNORE],
            Box::new(|row: &[u64]| {
                format!("{:?}", (row[IGNORE_SET] != 0).then_some(row[IGNORE] as i64))
            }),
        ),
        ("`options.skip_target_check`", &[SKIP], Box::new(flag(SKIP))),
        (
            "`options.temperature`",
            &[TEMPERATURE],
            Box::new(|row: &[u64]| f64::from_bits(row[TEMPERATURE]).to_string()),
        ),
        (
            "whether the entropy is computed (`tp::linear_logp_full` with `options.entropy`)",
            &[ENTROPY],
            Box::new(flag(ENTROPY)),
        ),
        (
            "whether `hidden` requires a gradient (every rank takes part in its backward)",
            &[GRAD],
            Box::new(flag(GRAD)),
        ),
        (
            "the implementation (ranks must run the same one)",
            &[IMPL],
            Box::new(|row: &[u64]| implementation_name(row[IMPL]).to_string()),
        ),
        (
            "the sampler's keys and options (a hash)",
            &[EXTRA],
            Box::new(|row: &[u64]| format!("{:#018x}", row[EXTRA])),
        ),
    ]
}

/// Every rank has rank 0's value of each agreed field.
fn check_agreement(table: &[&[u64]]) -> Result<(), InvariantError> {
    let first = table[0];
    for (what, words, render) in agreed_fields() {
        if let Some(rank) = table
            .iter()
            .position(|row| words.iter().any(|&w| row[w] != first[w]))
        {
            return Err(InvariantError::RankMismatch {
                what,
                rank,
                expected: render(first),
                got: render(table[rank]),
            });
        }
    }
    Ok(())
}

/// The shards are contiguous in rank order and cover `[0, V_global)`.
fn check_partition(table: &[&[u64]]) -> Result<(), InvariantError> {
    let vocab = table[0][VOCAB];
    let mut expected_start = 0u64;
    for (rank, row) in table.iter().enumerate() {
        if row[START] != expected_start {
            let why = if rank == 0 {
                "the first shard starts at 0".to_string()
            } else {
                format!("the end of rank {}'s shard", rank - 1)
            };
            return Err(InvariantError::Partition {
                rank,
                expected: format!("start = {expected_start} ({why})"),
                got: format!("[{}, {})", row[START], row[END]),
            });
        }
        expected_start = row[END];
    }
    if expected_start != vocab {
        let last = table.len() - 1;
        return Err(InvariantError::Partition {
            rank: last,
            expected: format!("the last shard to end at V_global = {vocab}"),
            got: format!("[{}, {})", table[last][START], table[last][END]),
        });
    }
    Ok(())
}

/// Every rank holds the same targets, each in `[0, V_global)` or ignored.
fn check_targets(table: &[&[u64]]) -> Result<(), InvariantError> {
    let first = table[0];
    if let Some(rank) = table.iter().position(|row| row[HASH] != first[HASH]) {
        return Err(InvariantError::RankMismatch {
            what: "the content of `targets` (every rank holds the global targets)",
            rank,
            expected: format!("hash {:#018x}", first[HASH]),
            got: format!("hash {:#018x}", table[rank][HASH]),
        });
    }
    if first[BAD_COUNT] > 0 {
        // Equal targets and V_global on every rank: rank 0's finding is everyone's.
        return Err(InvariantError::TargetOutOfRange {
            index: first[BAD_INDEX] as usize,
            value: first[BAD_VALUE] as i64,
            vocab: first[VOCAB] as usize,
            count: first[BAD_COUNT] as usize,
            ignore_index: (first[IGNORE_SET] != 0).then_some(first[IGNORE] as i64),
        });
    }
    Ok(())
}

/// Runs the local checks, exchanges the table and returns the plan and implementation, or the
/// same error on every rank. The exchange happens whatever the local outcome, so no rank waits
/// for one that gave up.
pub(crate) fn collective<B: InvariantBackend, G: Collective<B>>(
    inputs: &RankInputs<'_, B>,
    group: &G,
) -> Result<(Plan, Implementation), InvariantError> {
    let (rank, world) = (group.rank(), group.world_size());
    if world == 0 || rank >= world {
        return Err(InvariantError::Collective {
            reason: format!(
                "the group reports rank {rank} of world {world}: expected rank < world"
            ),
        });
    }
    let device = inputs.hidden.device();
    let mut trace = super::trace::Trace::<B>::start(&device);
    let mut row = vec![0u64; WORDS];
    row[RANK] = rank as u64;
    row[WORLD] = world as u64;
    let implementation = match local(inputs, group.device(), &mut row) {
        Ok(implementation) => Some(implementation),
        Err(error) => {
            row[FAILED] = 1;
            write_message(&mut row, &error.to_string());
            None
        }
    };
    trace.mark("validation: local checks and the targets read");
    let gathered = group.all_gather_host(&row)?;
    trace.mark("validation: table exchange");
    if gathered.len() != world * WORDS {
        return Err(InvariantError::Collective {
            reason: format!(
                "all-gather returned {} words, expected {world} ranks × {WORDS}",
                gathered.len()
            ),
        });
    }
    let table: Vec<&[u64]> = gathered.chunks(WORDS).collect();
    let shards = verdict(&table)?;
    let implementation = implementation.ok_or_else(|| InvariantError::Collective {
        reason: "internal: a failed rank passed the verdict".into(),
    })?;
    Ok((
        Plan::new(inputs.shard.global_vocab, shards, rank),
        implementation,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_truncate_on_char_boundaries() {
        let mut row = vec![0u64; WORDS];
        write_message(&mut row, "`weight`: expected dimension 0 = 75, got [74, 8]");
        assert_eq!(
            read_message(&row),
            "`weight`: expected dimension 0 = 75, got [74, 8]"
        );
        let long = "é".repeat(400);
        write_message(&mut row, &long);
        let back = read_message(&row);
        assert!(back.len() <= MSG_BYTES && long.starts_with(&back));
    }
}
