//! [`SeqTracker`]: ordering and gap recovery of one event stream (one worker, one DP rank),
//! as a pure state machine. Source: `kv-events.md` §2 (consumer state), §8.3–§8.5; bug cases
//! B22 (gaps), B33 (router restart), B34 (at most one recovery per real gap).
//!
//! States: **live** (apply in order) and **replaying** (a replay request is out: live batches
//! are buffered by seq until the replay ends, so a live removal can never be overtaken by an
//! older replayed store, and then drained in order).

use std::collections::{BTreeMap, VecDeque};

/// Most live batches buffered while a replay runs (the engines' `buffer_steps`); past it,
/// newer batches are dropped and the drain sees a gap it cannot fill (→ clear).
pub const MAX_BUFFERED_BATCHES: usize = 10_000;

/// Fewest batches applied between two orphan-triggered replays of one stream (B39): a parent
/// that has left the engine's buffer cannot be relearned, and replaying the whole buffer on
/// every orphan store would be a storm.
pub const ORPHAN_REPLAY_EVERY_BATCHES: u64 = 1_000;

/// Seqs remembered with a digest of their payload, to tell a duplicate (same seq, same bytes)
/// from an engine restart (same seq, other bytes).
const RECENT: usize = 1_024;

/// What the caller must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Decode and apply this batch; it is the next in seq order.
    Apply {
        /// Its seq.
        seq: u64,
        /// Its msgpack payload.
        payload: Vec<u8>,
    },
    /// Drop every entry of the stream before applying what follows.
    Clear(ClearReason),
    /// A batch already applied arrived again and was dropped.
    Duplicate {
        /// Its seq.
        seq: u64,
    },
    /// Send a replay request from `start_seq`; feed the replies, then one end.
    Replay {
        /// First seq wanted.
        start_seq: u64,
    },
    /// Apply this already-applied batch again, in seq order, without counting it (an
    /// orphan-triggered relearn, B39). Re-applying history `[k, last]` on the current state
    /// ends in the same state, plus the stores whose parents were missed.
    Reapply {
        /// Its seq.
        seq: u64,
        /// Its msgpack payload.
        payload: Vec<u8>,
    },
}

/// Why a stream was cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClearReason {
    /// Seq went backwards with new content: the engine's publisher restarted with an empty
    /// cache (`kv-events.md` §2).
    Restart,
    /// A gap that replay could not fill (no replay socket, buffer too short, timeout).
    GapUnrecoverable,
}

/// Seq state of one stream.
///
/// # Invariants
/// 1. Batches are applied in strictly increasing seq order between clears.
/// 2. Live batches are buffered only while replaying; the buffer is empty otherwise.
/// 3. At most one replay is outstanding at a time.
#[derive(Debug, Clone)]
pub struct SeqTracker {
    last: Option<u64>,
    replay_available: bool,
    replaying: bool,
    buffer: BTreeMap<u64, Vec<u8>>,
    recent: VecDeque<(u64, u64)>,
    /// While an orphan relearn runs: the last seq applied when it started.
    relearn_upto: Option<u64>,
    /// `last` when the previous orphan relearn was requested.
    last_relearn_at: Option<u64>,
}

fn digest(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

impl SeqTracker {
    /// New stream; `replay_available` says whether a replay socket is configured.
    pub fn new(replay_available: bool) -> Self {
        Self {
            last: None,
            replay_available,
            replaying: false,
            buffer: BTreeMap::new(),
            recent: VecDeque::new(),
            relearn_upto: None,
            last_relearn_at: None,
        }
    }

    /// Asks for a replay of the engine's whole buffer to relearn the parents of orphan stores
    /// (B39): returns the start seq to request, 0 (the engine starts at its oldest buffered
    /// batch), or `None` when no replay socket exists, a replay is already out,
    /// nothing was applied yet, or fewer than [`ORPHAN_REPLAY_EVERY_BATCHES`] batches were
    /// applied since the previous relearn. Replayed batches up to the current last seq come
    /// back as [`Step::Reapply`]; newer ones and the buffered live ones as usual.
    pub fn request_relearn(&mut self) -> Option<u64> {
        let last = self.last?;
        let due = self
            .last_relearn_at
            .is_none_or(|at| last >= at.saturating_add(ORPHAN_REPLAY_EVERY_BATCHES));
        if self.replaying || !self.replay_available || !due {
            return None;
        }
        self.replaying = true;
        self.relearn_upto = Some(last);
        self.last_relearn_at = Some(last);
        Some(0)
    }

    /// Last applied seq, `None` before the first.
    pub fn last_seq(&self) -> Option<u64> {
        self.last
    }

    /// True while a replay is outstanding.
    pub fn replaying(&self) -> bool {
        self.replaying
    }

    fn apply(&mut self, seq: u64, payload: Vec<u8>, out: &mut Vec<Step>) {
        self.last = Some(seq);
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, digest(&payload)));
        out.push(Step::Apply { seq, payload });
    }

    fn start_replay(&mut self, start_seq: u64, seq: u64, payload: &[u8], out: &mut Vec<Step>) {
        self.replaying = true;
        self.buffer.insert(seq, payload.to_vec());
        out.push(Step::Replay { start_seq });
    }

    /// A live batch arrived.
    pub fn on_live(&mut self, seq: u64, payload: &[u8]) -> Vec<Step> {
        let mut out = Vec::new();
        if self.replaying {
            if self.buffer.len() < MAX_BUFFERED_BATCHES {
                self.buffer.insert(seq, payload.to_vec());
            }
            return out;
        }
        match self.last {
            // Router (re)start: learn older stores from the engine's buffer when it has one
            // (B33); otherwise start from here.
            None if seq > 0 && self.replay_available => {
                self.start_replay(0, seq, payload, &mut out);
            }
            None => self.apply(seq, payload.to_vec(), &mut out),
            Some(l) if seq == l.wrapping_add(1) => self.apply(seq, payload.to_vec(), &mut out),
            Some(l) if seq > l => {
                if self.replay_available {
                    self.start_replay(l + 1, seq, payload, &mut out);
                } else {
                    out.push(Step::Clear(ClearReason::GapUnrecoverable));
                    self.apply(seq, payload.to_vec(), &mut out);
                }
            }
            Some(_) => {
                let d = digest(payload);
                if self.recent.iter().any(|&(s, pd)| s == seq && pd == d) {
                    out.push(Step::Duplicate { seq });
                } else {
                    out.push(Step::Clear(ClearReason::Restart));
                    self.recent.clear();
                    self.apply(seq, payload.to_vec(), &mut out);
                }
            }
        }
        out
    }

    /// Feeds one batch into the replay/drain order: duplicate, next, or past a hole.
    fn take_ordered(&mut self, seq: u64, payload: Vec<u8>, out: &mut Vec<Step>) {
        match self.last {
            Some(l) if seq <= l => out.push(Step::Duplicate { seq }),
            Some(l) if seq > l + 1 => {
                out.push(Step::Clear(ClearReason::GapUnrecoverable));
                self.apply(seq, payload, out);
            }
            // First batch ever (join): nothing indexed yet, nothing to clear.
            _ => self.apply(seq, payload, out),
        }
    }

    /// One replayed batch arrived. Ignored when no replay is outstanding (a late reply).
    pub fn on_replay(&mut self, seq: u64, payload: &[u8]) -> Vec<Step> {
        let mut out = Vec::new();
        if self.replaying {
            if self.relearn_upto.is_some_and(|upto| seq <= upto) {
                out.push(Step::Reapply {
                    seq,
                    payload: payload.to_vec(),
                });
                return out;
            }
            // A replayed seq is never newer than the buffered live ones it precedes; if it
            // is buffered already, the buffered copy is dropped as a duplicate at drain.
            self.take_ordered(seq, payload.to_vec(), &mut out);
        }
        out
    }

    /// The replay ended (end marker, timeout, no socket). Drains the buffered live batches in
    /// seq order; a hole left between them clears the stream once.
    pub fn on_replay_end(&mut self) -> Vec<Step> {
        let mut out = Vec::new();
        if !self.replaying {
            return out;
        }
        self.replaying = false;
        self.relearn_upto = None;
        let buffer = std::mem::take(&mut self.buffer);
        for (seq, payload) in buffer {
            self.take_ordered(seq, payload, &mut out);
        }
        out
    }

    /// Checks the invariants that can be seen from the state; the error names the broken
    /// one (1 is checked by the tests that record applied seqs).
    ///
    /// # Errors
    /// The number of the first broken invariant.
    pub fn check_invariants(&self) -> Result<(), u8> {
        if !self.replaying && !self.buffer.is_empty() {
            return Err(2);
        }
        if !self.replaying && self.relearn_upto.is_some() {
            return Err(4);
        }
        Ok(())
    }
}
