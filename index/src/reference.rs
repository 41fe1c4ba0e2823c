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
