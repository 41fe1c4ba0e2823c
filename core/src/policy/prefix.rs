//! [`PrefixIndex`]: what every cache index tells a policy — for a request in a namespace, the
//! overlap of *every* worker that holds any of it — and [`Overlaps`], that answer laid out by
//! worker id for one decision.
//!
//! | index | query | unit of the overlap | source |
//! |---|---|---|---|
//! | [`StringTree`] | text | chars | the router's own dispatches |
//! | [`TokenTree`] | token ids | tokens, whole pages | the router's own dispatches |
//! | [`HashIndex`] | token ids | tokens, at the deepest live boundary | the router's own dispatches |
//! | [`EventReader`] | router block keys | tokens, whole blocks (any tier) | the engines' KV events |
//!
//! A worker's overlap over several DP ranks is its best rank's.

use crate::events::EventReader;
use kvroute_index::{HashIndex, Namespace, StringTree, TenantId, TokenTree};

/// What a [`PrefixIndex`] is asked about: one request's prompt.
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    /// Prompt text (empty for a token-only request).
    pub text: &'a str,
    /// Prompt token ids, when the request has them.
    pub ids: Option<&'a [u32]>,
    /// Router block keys of `ids` ([`kvroute_index::keys::block_keys`] at the event index's
    /// block size); empty without ids.
    pub block_keys: &'a [u64],
    /// Block size of `block_keys`, tokens (the token tree walks on them when it is its own).
    pub block_size: usize,
    /// Time on the router's time base, ms (hash-index TTL).
    pub now_ms: u64,
}

/// The unit an index measures overlap in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Prompt chars (string tree).
    Chars,
    /// Prompt tokens.
    Tokens,
}

/// A cache index as a policy reads it.
pub trait PrefixIndex {
    /// The unit of [`PrefixIndex::overlaps`].
    fn unit(&self) -> Unit;

    /// Every worker holding a prefix of `q` in namespace `ns`, with the length of its longest
    /// held prefix in [`PrefixIndex::unit`]s, sorted by worker; workers holding nothing are
    /// absent. Reads only.
    fn overlaps(&self, ns: Namespace, q: &Query<'_>) -> Vec<(TenantId, usize)>;
}

impl PrefixIndex for StringTree {
    fn unit(&self) -> Unit {
        Unit::Chars
    }

    fn overlaps(&self, ns: Namespace, q: &Query<'_>) -> Vec<(TenantId, usize)> {
        if q.text.is_empty() {
            return Vec::new();
        }
        self.match_depths(ns, q.text)
    }
}

impl PrefixIndex for TokenTree {
    fn unit(&self) -> Unit {
        Unit::Tokens
    }

    /// On the request's block keys when they are at this tree's block size
    /// ([`TokenTree::match_depths_keyed`]), else on its ids.
    fn overlaps(&self, ns: Namespace, q: &Query<'_>) -> Vec<(TenantId, usize)> {
        match q.ids {
            None => Vec::new(),
            Some(ids) if q.block_size == self.block_size() => {
                self.match_depths_keyed(ns, ids, q.block_keys)
            }
            Some(ids) => self.match_depths(ns, ids),
        }
    }
}

impl PrefixIndex for HashIndex {
    fn unit(&self) -> Unit {
        Unit::Tokens
    }

    fn overlaps(&self, ns: Namespace, q: &Query<'_>) -> Vec<(TenantId, usize)> {
        q.ids
            .map_or_else(Vec::new, |ids| self.depths(ns, ids, q.now_ms))
    }
}

impl PrefixIndex for EventReader {
    fn unit(&self) -> Unit {
        Unit::Tokens
    }

    /// Engines' blocks are matched on router block keys, which carry the namespace already
    /// (each partition's chain is rooted at it: [`EventReader::block_keys`]), so `ns` is not
    /// read here: `q.block_keys` must be the request's keys in its namespace.
    fn overlaps(&self, _ns: Namespace, q: &Query<'_>) -> Vec<(TenantId, usize)> {
        // One entry per worker, its largest match over its DP ranks: sorted by (worker,
        // blocks), the last of each worker's run wins (O(m log m); a linear search per match
        // was O(m²), 4,096 matches at `kvroute bench fleet`'s fleet-wide system prompt).
        let mut out: Vec<(TenantId, usize)> = self.worker_tokens(q.block_keys);
        by_worker(&mut out);
        out
    }
}

/// `found` sorted by worker with one entry per worker, its largest overlap: sorted by
/// (worker, overlap), the last of each worker's run wins. Already sorted (the event index's
/// streams are numbered in the order workers first published, usually worker order), it costs
/// one pass.
pub fn by_worker(found: &mut Vec<(TenantId, usize)>) {
    if !found.is_sorted() {
        found.sort_unstable();
    }
    found.dedup_by(|later, earlier| {
        let same = later.0 == earlier.0;
        if same {
            earlier.1 = later.1;
        }
        same
    });
}

/// Which index an [`Overlaps`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The engines' KV events.
    Events,
    /// The token tree.
    TokenTree,
    /// The string tree.
    StringTree,
    /// The hash index.
    HashIndex,
    /// No index (no text, no ids, or no index for the model yet).
    None,
}

/// One decision's overlaps, by worker id.
#[derive(Debug, Clone)]
pub struct Overlaps {
    /// Where they came from.
    pub source: Source,
    /// Unit of `matched` and `len`.
    pub unit: Unit,
    /// The request's length, units (≥ 1).
    pub len: usize,
    /// Matched units (0 = holds nothing): by worker id, one per snapshot slot, when `ids` is
    /// empty; else one per entry of `ids`.
    pub matched: Vec<usize>,
    /// The worker id of each entry of `matched`, ascending, for a decision on a candidate set
    /// ([`super::Snapshot::ids`]); empty when `matched` is by worker id.
    pub ids: Vec<usize>,
    /// Prompt tokens per unit: 1 for tokens; for chars, the request's token estimate over
    /// its chars.
    pub tokens_per_unit: f64,
}

impl Overlaps {
    /// No overlap anywhere, for `workers` slots.
    pub fn none(workers: usize, len: usize, unit: Unit, tokens_per_unit: f64) -> Self {
        Self {
            source: Source::None,
            unit,
            len: len.max(1),
            matched: vec![0; workers],
            ids: Vec::new(),
            tokens_per_unit,
        }
    }

    /// Lays out `found` (an index's [`PrefixIndex::overlaps`]) by worker id over `workers`
    /// slots; workers beyond the slots are dropped.
    pub fn from_index(
        source: Source,
        unit: Unit,
        found: &[(TenantId, usize)],
        workers: usize,
        len: usize,
        tokens_per_unit: f64,
    ) -> Self {
        let mut o = Self::none(workers, len, unit, tokens_per_unit);
        o.source = source;
        for &(w, m) in found {
            if let Some(slot) = o.matched.get_mut(w as usize) {
                *slot = m.min(o.len);
            }
        }
        o
    }

    /// [`Overlaps::from_index`] laid out over the workers `ids` only (ascending: a
    /// snapshot's candidate set, [`super::Snapshot::ids`]); the other workers of `found` are
    /// dropped. `found` must be sorted by worker, one entry per worker (as
    /// [`super::Router`]'s answers are): one merge of the two ascending lists, O(|ids| +
    /// |found|).
    pub fn from_index_among(
        source: Source,
        unit: Unit,
        found: &[(TenantId, usize)],
        ids: &[usize],
        len: usize,
        tokens_per_unit: f64,
    ) -> Self {
        let mut o = Self::none(ids.len(), len, unit, tokens_per_unit);
        o.source = source;
        o.ids = ids.to_vec();
        debug_assert!(
            found.windows(2).all(|p| p[0].0 < p[1].0),
            "sorted, one per worker"
        );
        let mut at = 0;
        for (i, &w) in ids.iter().enumerate() {
            while at < found.len() && (found[at].0 as usize) < w {
                at += 1;
            }
            match found.get(at) {
                Some(&(f, m)) if f as usize == w => o.matched[i] = m.min(o.len),
                Some(_) => {}
                None => break,
            }
        }
        o
    }

    /// Matched units of worker `w` (0 for a worker the overlaps are not laid out over).
    pub fn of(&self, w: usize) -> usize {
        if self.ids.is_empty() {
            return self.matched.get(w).copied().unwrap_or(0);
        }
        self.ids.binary_search(&w).map_or(0, |i| self.matched[i])
    }

    /// [`Overlaps::of`] for worker `w` at `position` of a snapshot laid out as these
    /// overlaps are ([`super::Snapshot::eligible_positions`]): `matched[position]` when
    /// `ids[position]` is `w` (or `matched[w]` when by worker id), else the search of `of`.
    pub fn of_at(&self, position: usize, w: usize) -> usize {
        if self.ids.is_empty() {
            return self.matched.get(w).copied().unwrap_or(0);
        }
        match self.ids.get(position) {
            Some(&at) if at == w => self.matched[position],
            _ => self.of(w),
        }
    }

    /// [`Overlaps::tokens`] of worker `w` at `position` ([`Overlaps::of_at`]).
    pub fn tokens_at(&self, position: usize, w: usize) -> u64 {
        (self.of_at(position, w) as f64 * self.tokens_per_unit) as u64
    }

    /// Matched share of the request for worker `w`, 0–1.
    pub fn ratio(&self, w: usize) -> f64 {
        self.of(w) as f64 / self.len as f64
    }

    /// Predicted cached tokens of worker `w` (units × tokens per unit, rounded down).
    pub fn tokens(&self, w: usize) -> u64 {
        (self.of(w) as f64 * self.tokens_per_unit) as u64
    }

    /// The largest overlap among `workers`.
    pub fn max_among(&self, workers: impl IntoIterator<Item = usize>) -> usize {
        workers.into_iter().map(|w| self.of(w)).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{BlockStored, EventIndex, StreamId};
    use kvroute_index::HashIndexConfig;
    use kvroute_index::keys::{block_keys, local_hash};
    use kvroute_index::reference::{ReferenceEventIndex, ReferenceStringIndex};
    use proptest::prelude::*;

    /// Brute force for the token indexes: per worker, the longest common prefix with any
    /// prompt it was sent, cut down to whole pages of `page` (the tree's rule).
    fn brute_tokens(
        sent: &[(Vec<u32>, TenantId)],
        q: &[u32],
        page: usize,
    ) -> Vec<(TenantId, usize)> {
        let mut best: std::collections::BTreeMap<TenantId, usize> = Default::default();
        for (s, w) in sent {
            let lcp = s.iter().zip(q).take_while(|(a, b)| a == b).count() / page * page;
            if lcp > 0 {
                let e = best.entry(*w).or_insert(0);
                *e = (*e).max(lcp);
            }
        }
        best.into_iter().collect()
    }

    fn tokens_of(seed: u64, prefixes: &[Vec<u32>], tail: usize) -> Vec<u32> {
        let mut v = prefixes[(seed % prefixes.len() as u64) as usize].clone();
        v.extend((0..tail as u32).map(|i| 1_000 + (seed as u32).wrapping_mul(31) + i));
        v
    }

    proptest! {
        /// One differential harness, every index through the trait: the string tree, token
        /// tree, hash index and event index answer as brute-force references do, for random
        /// prompts over shared prefixes sent to random workers.
        #[test]
        fn every_index_answers_as_the_reference(
            sends in prop::collection::vec((0u64..40, 0u32..4, 0usize..40), 1..24),
            queries in prop::collection::vec((0u64..40, 0usize..40), 1..6),
        ) {
            let page = 4;
            let prefixes: Vec<Vec<u32>> = (0..3u32).map(|p| (0..(8 + 4 * p)).map(|i| p * 100 + i).collect()).collect();
            let mut string = StringTree::new();
            let mut string_ref = ReferenceStringIndex::new();
            let mut token = TokenTree::new(page, usize::MAX);
            let mut hash = HashIndex::new(HashIndexConfig { boundaries: vec![4, 8, 16, 32], ttl_ms: 1_000 }).unwrap();
            let mut events = EventIndex::new(page);
            let mut events_ref = ReferenceEventIndex::new();
            let mut sent = Vec::new();
            for &(seed, w, tail) in &sends {
                let ids = tokens_of(seed, &prefixes, tail);
                let text: String = ids.iter().map(|t| format!("<{t}>")).collect();
                string.insert(0, &text, w);
                string_ref.insert(&text, w);
                // Half the sends keyed (node end keys), so walks meet both kinds of node.
                if seed % 2 == 0 {
                    token.insert_keyed(0, &ids, w, &block_keys(&ids, page));
                } else {
                    token.insert(0, &ids, w);
                }
                hash.record(0, &ids, w, 0);
                // The engine stores each full block, chained, as events would say.
                let keys = block_keys(&ids, page);
                let mut parent = None;
                let mut chain = Vec::new();
                for (i, k) in keys.iter().enumerate() {
                    let block = &ids[i * page..(i + 1) * page];
                    let engine = k ^ 0x5555;
                    chain.push((engine, local_hash(block)));
                    let ev = BlockStored {
                        block_hashes: vec![engine],
                        parent_block_hash: parent,
                        token_ids: block.to_vec(),
                        block_size: page,
                        ..BlockStored::default()
                    };
                    events.stored(StreamId { worker: w, rank: 0 }, &ev);
                    parent = Some(engine);
                }
                events_ref.stored(w, None, &chain);
                sent.push((ids, w));
            }
            let reader = events.reader();
            for &(seed, tail) in &queries {
                let ids = tokens_of(seed, &prefixes, tail);
                let text: String = ids.iter().map(|t| format!("<{t}>")).collect();
                let keys = block_keys(&ids, page);
                let q = Query { text: &text, ids: Some(&ids), block_keys: &keys, block_size: page, now_ms: 0 };
                prop_assert_eq!(PrefixIndex::overlaps(&string, 0, &q), string_ref.match_depths(&text));
                let want = brute_tokens(&sent, &ids, page);
                prop_assert_eq!(PrefixIndex::overlaps(&token, 0, &q), want.clone());
                // The same without usable keys (another block size): the walk on ids.
                let unkeyed = Query { block_size: page + 1, ..q };
                prop_assert_eq!(PrefixIndex::overlaps(&token, 0, &unkeyed), want.clone());
                let events_want: Vec<(TenantId, usize)> = events_ref.find_matches(&keys).into_iter().map(|(w, b)| (w, b as usize * page)).collect();
                prop_assert_eq!(PrefixIndex::overlaps(&reader, 0, &q), events_want);
                // The hash index holds at boundaries only, at most 3 holders per head (a 4th
                // evicts the stalest): a worker's depth is a boundary no deeper than the
                // brute force's, cut down to a boundary.
                let cut = |d: usize| [32, 16, 8, 4].into_iter().find(|&b| b <= d).unwrap_or(0);
                for (w, d) in PrefixIndex::overlaps(&hash, 0, &q) {
                    let truth = want.iter().find(|e| e.0 == w).map_or(0, |e| cut(e.1));
                    prop_assert!([4, 8, 16, 32].contains(&d) && d <= truth, "worker {} {} {}", w, d, truth);
                }
            }
        }
    }

    #[test]
    fn overlaps_lay_out_by_worker() {
        let o = Overlaps::from_index(
            Source::TokenTree,
            Unit::Tokens,
            &[(1, 32), (3, 64), (9, 16)],
            4,
            64,
            1.0,
        );
        assert_eq!(o.matched, vec![0, 32, 0, 64]);
        assert_eq!(
            (o.ratio(1), o.tokens(3), o.max_among([0, 1, 2])),
            (0.5, 64, 32)
        );
        let c = Overlaps::from_index(Source::StringTree, Unit::Chars, &[(0, 400)], 1, 800, 0.25);
        assert_eq!(c.tokens(0), 100);
    }

    /// Laid out over candidates 2, 5, 9, 12: holders that are not candidates (1, 7, 20) are
    /// dropped, a match past the request's length is cut to it; a read at a position that
    /// does not name the worker falls back to the search.
    #[test]
    fn overlaps_lay_out_over_candidates() {
        let found = [(1, 8), (2, 16), (7, 4), (9, 80), (12, 32), (20, 48)];
        let o = Overlaps::from_index_among(
            Source::Events,
            Unit::Tokens,
            &found,
            &[2, 5, 9, 12],
            64,
            1.0,
        );
        assert_eq!(
            (o.ids.as_slice(), o.matched.as_slice()),
            (&[2, 5, 9, 12][..], &[16, 0, 64, 32][..])
        );
        assert_eq!([o.of_at(0, 2), o.of_at(2, 9), o.of_at(3, 12)], [16, 64, 32]);
        assert_eq!([o.of_at(0, 9), o.of_at(7, 12), o.of_at(1, 1)], [64, 32, 0]);
        assert_eq!(o.tokens_at(2, 9), 64);
        let by_id = Overlaps::from_index(Source::Events, Unit::Tokens, &found, 13, 64, 1.0);
        assert_eq!((by_id.of_at(0, 9), by_id.of_at(9, 9)), (64, 64));
    }
}
