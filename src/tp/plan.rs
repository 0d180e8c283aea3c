//! The segment rule and the fixed reduction tree (pure index arithmetic, no tensors).
//!
//! The tree is built over the [`SEGMENTS`] segments of `[0, V_global)` by halving:
//! `node(lo, hi) = combine(node(lo, mid), node(mid, hi))`, `mid = lo + (hi − lo) / 2`. A rank
//! evaluates the largest nodes lying inside its shard; the gathered rank values are then
//! combined by the upper levels of the same tree on every rank. A segment cut by a shard
//! boundary (unaligned shards) is a left fold of its pieces in rank order.
/// Number of vocabulary segments. Statistics and `dHidden` contributions are reduced within a
/// segment first, then over segments in one fixed binary tree; world sizes that divide it
/// (1, 2, 4, 8) with shards on segment boundaries give bitwise identical results.
pub const SEGMENTS: usize = 8;

/// Segment boundaries are multiples of this when `V_global ≥ SEGMENTS · SEGMENT_ALIGN`: a
/// multiple of every implementation's vocabulary tile, so segments are whole tiles (tested).
pub const SEGMENT_ALIGN: usize = 256;

/// The segment boundaries `b_0 = 0 ≤ b_1 ≤ … ≤ b_8 = V_global`; a function of `V_global` only:
/// `b_k = A·⌊k·V / (8·A)⌋` with `A =` [`SEGMENT_ALIGN`] when `V ≥ 8·A`, else `A = 1`. With
/// `V ≥ 8` every segment is non-empty; with `V ≥ 8·A` every segment is at least `A` wide.
pub fn segment_bounds(global_vocab: usize) -> [usize; SEGMENTS + 1] {
    let align = if global_vocab >= SEGMENTS * SEGMENT_ALIGN {
        SEGMENT_ALIGN as u128
    } else {
        1
    };
    let v = global_vocab as u128;
    let segments = SEGMENTS as u128;
    std::array::from_fn(|k| {
        if k == SEGMENTS {
            global_vocab
        } else {
            (align * (k as u128 * v / (segments * align))) as usize
        }
    })
}

/// One value a rank computes and contributes to the all-gather.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Item {
    /// Tree node `[lo, hi)` over segments, wholly inside the rank's shard: the rank evaluates
    /// the subtree itself.
    Node { lo: usize, hi: usize },
    /// The part `[start, end)` (global vocabulary rows) of a segment cut by a shard boundary.
    Piece { start: usize, end: usize },
}

/// Where a node of the global tree gets its value from, after the all-gather.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Source {
    /// An empty node: the identity of the combine (lse −∞, dHidden 0).
    Identity,
    /// Item `index` of rank `rank`.
    Gathered { rank: usize, index: usize },
    /// A segment cut by shard boundaries: its pieces `(rank, index)` folded left in rank order.
    Fold(Vec<(usize, usize)>),
    /// `combine(left, right)`.
    Combine(Box<Source>, Box<Source>),
}

/// The validated layout of one tensor-parallel call: the segment boundaries, every rank's
/// shard, what each rank contributes and how the contributions are combined. Built by
/// `tp::linear_logp` after the collective validation; identical on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub(crate) bounds: [usize; SEGMENTS + 1],
    pub(crate) shards: Vec<(usize, usize)>,
    pub(crate) rank: usize,
    pub(crate) items: Vec<Vec<Item>>,
    pub(crate) root: Source,
}

impl Plan {
    /// `shards` must be a contiguous partition of `[0, global_vocab)` into non-empty ranges.
    pub(crate) fn new(global_vocab: usize, shards: Vec<(usize, usize)>, rank: usize) -> Self {
        let bounds = segment_bounds(global_vocab);
        let mut items = vec![Vec::new(); shards.len()];
        let root = build(0, SEGMENTS, &bounds, &shards, &mut items);
        Self {
            bounds,
            shards,
            rank,
            items,
            root,
        }
    }

    /// This rank's `[start, end)`.
    pub(crate) fn shard(&self) -> (usize, usize) {
        self.shards[self.rank]
    }

    /// The items this rank contributes, in ascending vocabulary order.
    pub(crate) fn local_items(&self) -> &[Item] {
        &self.items[self.rank]
    }

    /// Items per rank in the all-gather (the most any rank has; others pad).
    pub(crate) fn block(&self) -> usize {
        self.items.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// The world size.
    pub(crate) fn world(&self) -> usize {
        self.shards.len()
    }

    /// Evaluates one local item; `leaf(start, end)` computes a non-empty vocabulary range that
    /// is a whole segment or a piece. Leaves are visited in ascending order.
    pub(crate) fn eval_item<T>(
        &self,
        item: Item,
        leaf: &mut impl FnMut(usize, usize) -> T,
        identity: &impl Fn() -> T,
        combine: &impl Fn(T, T) -> T,
    ) -> T {
        match item {
            Item::Node { lo, hi } => self.eval_node(lo, hi, leaf, identity, combine),
            Item::Piece { start, end } => leaf(start, end),
        }
    }

    fn eval_node<T>(
        &self,
        lo: usize,
        hi: usize,
        leaf: &mut impl FnMut(usize, usize) -> T,
        identity: &impl Fn() -> T,
        combine: &impl Fn(T, T) -> T,
    ) -> T {
        let (start, end) = (self.bounds[lo], self.bounds[hi]);
        if start == end {
            identity()
        } else if hi - lo == 1 {
            leaf(start, end)
        } else {
            let mid = lo + (hi - lo) / 2;
            let left = self.eval_node(lo, mid, leaf, identity, combine);
            let right = self.eval_node(mid, hi, leaf, identity, combine);
            combine(left, right)
        }
    }

    /// Evaluates the global tree from the gathered items (`get(rank, index)`).
    pub(crate) fn eval_global<T>(
        &self,
        get: &impl Fn(usize, usize) -> T,
        identity: &impl Fn() -> T,
        combine: &impl Fn(T, T) -> T,
    ) -> T {
        eval_source(&self.root, get, identity, combine)
    }
}

fn eval_source<T>(
    source: &Source,
    get: &impl Fn(usize, usize) -> T,
    identity: &impl Fn() -> T,
    combine: &impl Fn(T, T) -> T,
) -> T {
    match source {
        Source::Identity => identity(),
        Source::Gathered { rank, index } => get(*rank, *index),
        Source::Fold(pieces) => {
            let mut iter = pieces.iter().map(|&(rank, index)| get(rank, index));
            let first = iter.next().unwrap_or_else(identity);
            iter.fold(first, combine)
        }
        Source::Combine(left, right) => {
            let left = eval_source(left, get, identity, combine);
            let right = eval_source(right, get, identity, combine);
            combine(left, right)
        }
    }
}

/// Mirrors [`Plan::eval_node`]: the same empty-node shortcut and the same halving, so a rank's
/// local subtree is exactly the corresponding subtree of the global one.
fn build(
    lo: usize,
    hi: usize,
    bounds: &[usize; SEGMENTS + 1],
    shards: &[(usize, usize)],
    items: &mut [Vec<Item>],
) -> Source {
    let (start, end) = (bounds[lo], bounds[hi]);
    if start == end {
        return Source::Identity;
    }
    let mut push = |rank: usize, item: Item| {
        items[rank].push(item);
        Source::Gathered {
            rank,
            index: items[rank].len() - 1,
        }
    };
    if let Some(rank) = shards.iter().position(|&(s, e)| s <= start && end <= e) {
        return push(rank, Item::Node { lo, hi });
    }
    if hi - lo == 1 {
        let pieces = shards
            .iter()
            .enumerate()
            .filter_map(|(rank, &(s, e))| {
                let (a, b) = (s.max(start), e.min(end));
                (a < b).then(|| {
                    items[rank].push(Item::Piece { start: a, end: b });
                    (rank, items[rank].len() - 1)
                })
            })
            .collect();
        return Source::Fold(pieces);
    }
    let mid = lo + (hi - lo) / 2;
    let left = build(lo, mid, bounds, shards, items);
    let right = build(mid, hi, bounds, shards, items);
    Source::Combine(Box::new(left), Box::new(right))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aligned(v: usize, world: usize) -> Vec<(usize, usize)> {
        let b = segment_bounds(v);
        let per = SEGMENTS / world;
        (0..world).map(|r| (b[r * per], b[(r + 1) * per])).collect()
    }

    /// The tree as a string over segment ranges, resolving gathered items to their nodes.
    fn shape(plan: &Plan) -> String {
        plan.eval_global(
            &|rank, index| match plan.items[rank][index] {
                Item::Node { lo, hi } => plan.eval_node(
                    lo,
                    hi,
                    &mut |s, e| format!("[{s},{e})"),
                    &|| "0".into(),
                    &|a, b| format!("({a}+{b})"),
                ),
                Item::Piece { start, end } => format!("<{start},{end}>"),
            },
            &|| "0".into(),
            &|a, b| format!("({a}+{b})"),
        )
    }

    #[test]
    fn segments_are_whole_vocabulary_tiles() {
        assert_eq!(SEGMENT_ALIGN % crate::oracle::VOCAB_TILE, 0);
        #[cfg(feature = "cubecl")]
        assert_eq!(
            SEGMENT_ALIGN % burn_invariant_cubecl::consts::LOGP_VOCAB_TILE,
            0
        );
    }

    #[test]
    fn bounds_rule() {
        assert_eq!(
            segment_bounds(600),
            [0, 75, 150, 225, 300, 375, 450, 525, 600]
        );
        assert_eq!(segment_bounds(131072), std::array::from_fn(|k| k * 16384));
        let b = segment_bounds(50257);
        assert_eq!(b[8], 50257);
        assert!(b[..8].iter().all(|x| x % 256 == 0));
        assert!(b.windows(2).all(|w| w[1] - w[0] >= 256));
        assert_eq!(segment_bounds(3), [0, 0, 0, 1, 1, 1, 2, 2, 3]);
    }

    #[test]
    fn aligned_worlds_share_one_tree() {
        for v in [600, 2100, 50257] {
            let reference = shape(&Plan::new(v, aligned(v, 1), 0));
            for world in [2, 4, 8] {
                let plan = Plan::new(v, aligned(v, world), 0);
                assert_eq!(plan.block(), 1, "v={v} world={world}");
                assert_eq!(shape(&plan), reference, "v={v} world={world}");
            }
        }
    }

    #[test]
    fn unaligned_shards_cover_the_vocabulary_once() {
        let v = 2048;
        let shards = vec![(0, 700), (700, 1500), (1500, 2048)];
        let plan = Plan::new(v, shards.clone(), 1);
        assert_eq!(
            plan.items,
            vec![
                vec![
                    Item::Node { lo: 0, hi: 2 },
                    Item::Piece {
                        start: 512,
                        end: 700
                    }
                ],
                vec![
                    Item::Piece {
                        start: 700,
                        end: 768
                    },
                    Item::Node { lo: 3, hi: 4 },
                    Item::Node { lo: 4, hi: 5 },
                    Item::Piece {
                        start: 1280,
                        end: 1500
                    },
                ],
                vec![
                    Item::Piece {
                        start: 1500,
                        end: 1536
                    },
                    Item::Node { lo: 6, hi: 8 }
                ],
            ]
        );
        assert_eq!(plan.block(), 4);
        // Every rank's leaves tile its shard in ascending order.
        for (rank, &(s, e)) in shards.iter().enumerate() {
            let mut leaves = Vec::new();
            for &item in &plan.items[rank] {
                plan.eval_item(item, &mut |a, b| leaves.push((a, b)), &|| (), &|_, _| ());
            }
            assert_eq!(leaves.first().map(|l| l.0), Some(s));
            assert_eq!(leaves.last().map(|l| l.1), Some(e));
            assert!(leaves.windows(2).all(|w| w[0].1 == w[1].0));
        }
    }

    #[test]
    fn tiny_vocabulary_has_empty_segments() {
        let plan = Plan::new(3, vec![(0, 1), (1, 3)], 0);
        let mut leaves = Vec::new();
        for rank in 0..2 {
            for &item in &plan.items[rank] {
                plan.eval_item(item, &mut |a, b| leaves.push((a, b)), &|| (), &|_, _| ());
            }
        }
        assert_eq!(leaves, vec![(0, 1), (1, 2), (2, 3)]);
    }
}
