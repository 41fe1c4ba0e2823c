//! Brute-force reference models, written from the API contract rather than from the fast
//! structures, for tests and benches (ground truth and speed baseline). Not for routing.

use crate::TenantId;
use std::collections::BTreeSet;

/// Every `(text, tenant)` ever inserted, kept verbatim; queries scan them all.
///
/// Cost: `match_prefix` is O(Σ stored chars). No eviction model.
#[derive(Clone, Debug, Default)]
pub struct ReferenceStringIndex {
    entries: Vec<(Vec<char>, TenantId)>,
}

/// Answer of [`ReferenceStringIndex::match_prefix`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReferenceMatch {
    /// Max over stored strings of the longest common prefix with the query, in chars.
    pub matched_chars: usize,
    /// Every tenant that stored a string starting with the matched prefix; empty when
    /// `matched_chars == 0`.
    pub tenants: BTreeSet<TenantId>,
}

impl ReferenceStringIndex {
    /// Empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores `text` for `tenant` (empty text is stored too; it never matches).
    pub fn insert(&mut self, text: &str, tenant: TenantId) {
        self.entries.push((text.chars().collect(), tenant));
    }

    /// Forgets every string stored for `tenant`.
    pub fn remove_tenant(&mut self, tenant: TenantId) {
        self.entries.retain(|&(_, t)| t != tenant);
    }

    /// Longest common char prefix of `text` with any stored string, and all tenants whose
    /// strings share that full prefix.
    pub fn match_prefix(&self, text: &str) -> ReferenceMatch {
        let q: Vec<char> = text.chars().collect();
        self.match_chars(&q)
    }

    /// [`Self::match_prefix`] on a query already split into chars.
    pub fn match_chars(&self, q: &[char]) -> ReferenceMatch {
        let lcp = |s: &[char]| s.iter().zip(q).take_while(|(a, b)| a == b).count();
        let matched_chars = self.entries.iter().map(|(s, _)| lcp(s)).max().unwrap_or(0);
        let tenants = if matched_chars == 0 {
            BTreeSet::new()
        } else {
            self.entries
                .iter()
                .filter(|(s, _)| lcp(s) >= matched_chars)
                .map(|&(_, t)| t)
                .collect()
        };
        ReferenceMatch {
            matched_chars,
            tenants,
        }
    }

    /// Per tenant, the longest common char prefix of `text` with any of its stored strings;
    /// tenants whose longest is 0 are absent; sorted by tenant.
    pub fn match_depths(&self, text: &str) -> Vec<(TenantId, usize)> {
        let q: Vec<char> = text.chars().collect();
        let mut best: std::collections::BTreeMap<TenantId, usize> = Default::default();
        for (s, t) in &self.entries {
            let lcp = s.iter().zip(&q).take_while(|(a, b)| a == b).count();
            if lcp > 0 {
                let e = best.entry(*t).or_default();
                *e = (*e).max(lcp);
            }
        }
        best.into_iter().collect()
    }

    /// Chars of distinct stored strings of `tenant` counted as a trie would: the number of
    /// distinct non-empty prefixes among them.
    pub fn tenant_chars(&self, tenant: TenantId) -> usize {
        let mut prefixes: BTreeSet<&[char]> = BTreeSet::new();
        for (s, _) in self.entries.iter().filter(|&&(_, t)| t == tenant) {
            for end in 1..=s.len() {
                prefixes.insert(&s[..end]);
            }
        }
        prefixes.len()
    }

    /// Distinct tenants with at least one stored string.
    pub fn tenants(&self) -> BTreeSet<TenantId> {
        self.entries.iter().map(|&(_, t)| t).collect()
    }
}

/// Brute-force event index: per worker, engine hash → (block key, parent engine hash), as
/// the event contract describes it; a match scans every worker's set block by block.
///
/// Cost: `find_matches` is O(workers × len). Also the naive baseline of `kvroute bench index`.
#[derive(Clone, Debug, Default)]
pub struct ReferenceEventIndex {
    workers: std::collections::BTreeMap<TenantId, std::collections::HashMap<u64, u64>>,
}

impl ReferenceEventIndex {
    /// Empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores blocks (already keyed) for `worker` under `parent`; `false` (nothing stored)
    /// when the parent is unknown. Keys are chained from the parent's key with
    /// [`crate::keys::chain`].
    pub fn stored(&mut self, worker: TenantId, parent: Option<u64>, blocks: &[(u64, u64)]) -> bool {
        let map = self.workers.entry(worker).or_default();
        let mut prev = match parent {
            None => None,
            Some(p) => match map.get(&p) {
                Some(&k) => Some(k),
                None => return false,
            },
        };
        for &(eh, local) in blocks {
            let k = crate::keys::chain(prev, local);
            map.entry(eh).or_insert(k);
            prev = Some(k);
        }
        true
    }

    /// Removes blocks by engine hash (unknown ones ignored).
    pub fn removed(&mut self, worker: TenantId, hashes: &[u64]) {
        if let Some(m) = self.workers.get_mut(&worker) {
            for h in hashes {
                m.remove(h);
            }
        }
    }

    /// Drops every block of `worker`.
    pub fn cleared(&mut self, worker: TenantId) {
        self.workers.remove(&worker);
    }

    /// Per worker holding `keys[0]`: consecutive leading keys held, sorted by worker.
    pub fn find_matches(&self, keys: &[u64]) -> Vec<(TenantId, u32)> {
        let mut out = Vec::new();
        for (&w, m) in &self.workers {
            let held: std::collections::HashSet<u64> = m.values().copied().collect();
            let n = keys.iter().take_while(|k| held.contains(k)).count();
            if n > 0 {
                out.push((w, n as u32));
            }
        }
        out
    }

    /// Blocks held by `worker`.
    pub fn worker_blocks(&self, worker: TenantId) -> usize {
        self.workers.get(&worker).map_or(0, |m| m.len())
    }
}

/// Naive per-worker key sets: the "per-worker HashSet scan" baseline of the benches.
#[derive(Clone, Debug, Default)]
pub struct NaiveWorkerSets {
    /// One set of held block keys per worker id.
    pub sets: Vec<std::collections::HashSet<u64>>,
}

impl NaiveWorkerSets {
    /// For every worker, consecutive leading `keys` in its set (0 included).
    pub fn find_matches(&self, keys: &[u64]) -> Vec<u32> {
        self.sets
            .iter()
            .map(|s| keys.iter().take_while(|k| s.contains(k)).count() as u32)
            .collect()
    }
}

/// Words of the synthetic prompts used by the string-tree benches: multibyte and emoji
/// included so the benches exercise UTF-8 edges.
const CORPUS_WORDS: &[&str] = &[
    "the", "cache", "worker", "prefix", "token", "router", "é", "naïve", "中文", "😀", "model",
    "prefill", "decode", "latency", "request", "batch",
];

/// SplitMix64: advances `*state` and returns the next value (the benches' only RNG, so the
/// index crate needs no `rand` dependency).
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Deterministic token ids for benches: `n` ids in `0..150_000` (a Qwen-sized vocabulary)
/// drawn by SplitMix64 from `seed`; equal seeds give equal streams.
pub fn token_stream(seed: u64, n: usize) -> Vec<u32> {
    let mut state = seed;
    (0..n)
        .map(|_| (splitmix(&mut state) % 150_000) as u32)
        .collect()
}

/// Tokens of the shared system prompt of [`token_conversations`] of `tokens` ids:
/// min(1,024, tokens / 2).
pub fn token_system_len(tokens: usize) -> usize {
    1024.min(tokens / 2)
}

/// `conversations` token sequences of `tokens` ids each, the event-index and token-tree
/// benches' fixture (criterion and `kvroute bench index`): a shared system prompt of
/// [`token_system_len`] ids (stream 1), then ids of conversation `c`'s own (stream 100 + c).
pub fn token_conversations(conversations: usize, tokens: usize) -> Vec<Vec<u32>> {
    let system = token_stream(1, token_system_len(tokens));
    (0..conversations as u64)
        .map(|c| {
            let mut v = system.clone();
            v.extend(token_stream(100 + c, tokens - system.len()));
            v
        })
        .collect()
}

/// Deterministic text of exactly `chars` chars: words from a fixed list drawn by SplitMix64
/// from `*state` (advanced), separated by spaces. For benches (no `rand` dependency).
pub fn synthetic_words(state: &mut u64, chars: usize) -> String {
    let mut next = || splitmix(state);
    let mut s = String::new();
    let mut n = 0;
    while n < chars {
        let w = CORPUS_WORDS[(next() % CORPUS_WORDS.len() as u64) as usize];
        s.push_str(w);
        s.push(' ');
        n += w.chars().count() + 1;
    }
    s.chars().take(chars).collect()
}

/// `conversations` chat-shaped routing texts of about `prompt_chars` chars each: one of
/// `system_prompts` shared system prompts (`system_chars` chars), then a unique user part; the
/// tenant of conversation `c` is `c % tenants`. Deterministic in `seed`. The string-tree
/// benches (criterion and `kvroute bench index`) share this corpus.
pub fn conversation_corpus(
    seed: u64,
    conversations: usize,
    prompt_chars: usize,
    system_prompts: usize,
    system_chars: usize,
    tenants: TenantId,
) -> Vec<(String, TenantId)> {
    let mut state = seed;
    let systems: Vec<String> = (0..system_prompts.max(1))
        .map(|i| format!("<|system|>{i}{}", synthetic_words(&mut state, system_chars)))
        .collect();
    (0..conversations)
        .map(|c| {
            let sys = &systems[c % systems.len()];
            let body = prompt_chars.saturating_sub(sys.chars().count() + 40);
            let conv = format!("{sys}<|user|>{c} {}", synthetic_words(&mut state, body));
            (conv, c as TenantId % tenants.max(1))
        })
        .collect()
}

#[cfg(test)]
mod corpus_tests {
    use super::*;

    #[test]
    fn synthetic_words_are_exact_length_and_deterministic() {
        let (mut a, mut b) = (7u64, 7u64);
        let x = synthetic_words(&mut a, 333);
        assert_eq!(x.chars().count(), 333);
        assert_eq!(x, synthetic_words(&mut b, 333));
        let mut other = 8u64;
        assert_ne!(
            synthetic_words(&mut other, 333),
            x,
            "another seed, another text"
        );
        let corpus = conversation_corpus(1, 12, 500, 3, 100, 5);
        assert_eq!(corpus.len(), 12);
        assert!(corpus[0].0.starts_with("<|system|>0") && corpus[3].0.starts_with("<|system|>0"));
        assert_eq!(corpus[7].1, 2);
    }
}
