//! Worker URL → id for the URL-taking recording methods of [`super::Metrics`], which keep
//! working for callers that only have a worker's URL while every exposed `worker` label is
//! the id. A record for a URL not learned yet is held (a count per distinct record) until
//! [`UrlIds::learn`] names its id; it is never exposed under the URL.

use super::HitTokens;
use std::collections::HashMap;
use std::sync::{Mutex, PoisonError, RwLock};

/// A record of a URL-taking method, without its worker.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Pending {
    /// [`super::Metrics::on_response`] with a worker: `kvroute_requests_total` and
    /// `kvroute_worker_requests_total`.
    Response {
        /// The route label.
        route: String,
        /// The HTTP status.
        status: u16,
    },
    /// [`super::Metrics::on_upstream_error`]: its kind.
    Error(String),
    /// [`super::Metrics::on_hit_outcome`]: one hit's token sums.
    Hit(HitTokens),
}

/// The URLs learned and the records held for URLs not learned yet.
#[derive(Debug, Default)]
pub(super) struct UrlIds {
    ids: RwLock<HashMap<String, usize>>,
    held: Mutex<HashMap<(String, Pending), u64>>,
}

impl UrlIds {
    fn id(&self, url: &str) -> Option<usize> {
        self.ids
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(url)
            .copied()
    }

    /// `Some((id, pending))` to record now when `url` is known; else holds `n` of
    /// `pending` for `url` and returns `None`. The second look-up under the hold lock
    /// makes a record that races with [`UrlIds::learn`] either held before `learn` drains or
    /// resolved after it, never lost.
    pub(super) fn resolve_or_hold(
        &self,
        url: &str,
        pending: Pending,
        n: u64,
    ) -> Option<(usize, Pending)> {
        if let Some(id) = self.id(url) {
            return Some((id, pending));
        }
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(id) = self.id(url) {
            return Some((id, pending));
        }
        *held.entry((url.to_string(), pending)).or_default() += n;
        None
    }

    /// Learns `urls` (URL, id) and returns the held records of the URLs now known:
    /// `(id, record, count)`; records of still unknown URLs stay held.
    pub(super) fn learn(&self, urls: Vec<(String, usize)>) -> Vec<(usize, Pending, u64)> {
        // Lock order everywhere: `held` before `ids`, never `ids` held while taking `held`.
        let new = urls.iter().any(|(u, id)| self.id(u) != Some(*id));
        if !new
            && self
                .held
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty()
        {
            return Vec::new();
        }
        self.ids
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(urls);
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out = Vec::new();
        held.retain(|(url, pending), n| match self.id(url) {
            Some(id) => {
                out.push((id, pending.clone(), *n));
                false
            }
            None => true,
        });
        out
    }
}
