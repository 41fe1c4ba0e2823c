//! [`ChatCache`]: a chat request's routing key and token ids at a cost that grows with its new
//! messages, not with the conversation.
//!
//! A chat client resends the whole conversation every turn, and the bytes of turn N+1's body
//! start with turn N's bytes up to the end of its last message (same serializer, same key
//! order). So the router keeps, for the last messages of each body it tokenized, the state
//! after that message, keyed by the xxh3-128 hash and the length of the body bytes up to it:
//! the flattened routing text and media keys (what [`crate::route_key::route_key`] builds),
//! and the token ids of the chat template's text up to that message. A request then costs:
//!
//! 1. one `memchr` pass for `}` followed by `,` or `]` (candidate message ends), and one
//!    streaming xxh3 pass over the bytes up to the last of them;
//! 2. at most [`MAX_PROBES`] lookups, from the last candidate back: the longest cached prefix;
//! 3. a strict structural scan of the bytes after it ([`scan_rest`]) and a JSON parse of each
//!    new message and of the other top-level fields (the head before `messages` and the tail
//!    after it, joined into one small object), so a malformed suffix is never accepted: any
//!    surprise falls back to the full path, which reports the error;
//! 4. the Qwen3 template rendered for the new messages only ([`kvroute_tokenize::native`]),
//!    and the tokenizer run on that text only. The cached text ends where a message ends,
//!    just before the next `<|im_start|>` (a template cut: the ids of the pieces concatenate
//!    to the ids of the whole, `kvroute_tokenize::incremental`);
//! 5. the key's ids: the cached ones then the new ones, appended in place to the
//!    conversation's buffer ([`TokenIds::head_then`]), so no step copies the conversation's
//!    ids (the routing text, needed only for a key left in text mode, is a [`Chain`]).
//!
//! Why this is exact: the cached bytes were a valid prefix of a body that parsed, and JSON
//! parsing is left to right, so any body with the same first bytes is in the same state
//! there (just after one element of the top-level `messages` array, `head` fields read). A
//! message's rendering depends only on itself, except that the template wraps the *last*
//! message in an empty `<think>` block when it is an assistant's after the last user query
//! ([`native::think_wrapped`]): a prefix ending with such a message is never cached, and a
//! prefix whose last message could be wrapped is not used for a body that ends there.
//!
//! Scope: the Qwen3 template rendered natively (plain bodies: see `kvroute_tokenize::native`)
//! and no routing-tokens header. Everything else takes [`crate::route_key::route_key`] and
//! [`crate::tokens::ShardTokenizers::attach`]. A hash collision (2^-128 per pair of distinct
//! prefixes of one length, or one crafted by a client against its own requests) could only
//! misroute: the body is forwarded unchanged.
//!
//! One cache for all models and shards (a conversation's next turn may reach another core),
//! behind a mutex held only for the lookups and the inserts. Its budget counts what entries
//! hold in token-equivalents ([`Prefix::cost`]); least recently used entries go first,
//! O(evicted).

use crate::CoreError;
use crate::ids::TokenIds;
use crate::route_key::{Endpoint, Messages, RouteKey, TokenSource, key_from_fields, parse_fields};
use crate::tokens::{Attached, BlockKeyMemo, BlockKeys, ShardTokenizers};
use kvroute_tokenize::native::{self, PlainMessage, RenderOptions, skip_string, skip_ws};
use kvroute_tokenize::{IncrementalTokenizer, TokenizeError};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use twox_hash::XxHash3_128;

/// At most this many cached-prefix lookups per request, from its last message end back.
/// Message ends are what is cached; 64 covers a client that edits or drops the last 63
/// messages, and bounds a miss to 64 hash-map probes (~2 µs).
pub const MAX_PROBES: usize = 64;

/// On a miss, a message end is cached only when the template text after it is at most this
/// long, bytes: its token count is found by tokenizing that text again (~50 ns per token on
/// the fast path), so a long last message (a grown single-message prompt) is not tokenized
/// twice.
pub const MAX_SUFFIX_BYTES: usize = 4096;

/// Message ends cached per request, counted from its end: the last message (what the next
/// turn reuses) and the two before it (reused when a client regenerates or edits the last
/// turn). Mirrors `kvroute_tokenize::incremental::ENTRIES_PER_PROMPT`.
pub const ENTRIES_PER_REQUEST: usize = 3;

/// Stale records [`ChatCache`]'s order may hold beyond one per entry before they are
/// dropped (invariant 1): a small cache does not compact at every hit.
const COMPACT_SLACK: usize = 64;

/// The state after the first messages of a body: what a body starting with the same bytes
/// reuses.
#[derive(Debug)]
struct Prefix {
    /// Body bytes covered: just past the closing `}` of message `messages − 1`.
    bytes: usize,
    /// Offset of the `"messages"` key's opening quote (the head fields are before it).
    key: usize,
    /// [`kvroute_tokenize::IncrementalTokenizer::cache_id`] of the tokenizer that made `ids`.
    tokenizer: usize,
    /// Messages covered.
    messages: usize,
    /// Index of the last real user query among them ([`PlainMessage::is_query`]).
    last_query: Option<usize>,
    /// The last covered message would be wrapped if it were a body's last
    /// ([`native::think_wrapped`]).
    last_wrappable: bool,
    /// Token ids of the template text of the covered messages.
    ids: TokenIds,
    /// Routing text ([`RouteKey::text`]) of the covered messages: the first `text_len` bytes
    /// of `text`. (Their media keys are none: a message in scope has string content.)
    text: Arc<Chain>,
    text_len: usize,
    /// Block keys of the ids of the request that made this entry, once the router computed
    /// them ([`crate::tokens::BlockKeyMemo`]); shared by that request's entries.
    block_keys: Arc<OnceLock<Arc<BlockKeys>>>,
}

/// Most links in a [`Chain`]: a longer one is copied into a single link, so reading a prefix
/// costs at most this many segment copies (and the copy, every `MAX_LINKS` turns of a
/// conversation, amortises to O(new) per turn).
const MAX_LINKS: usize = 16;

/// The routing text of a conversation, shared by cache entries without copying it per turn:
/// the first `parent.1` bytes of `parent.0`, then `own`. A turn's entries link to the prefix
/// they extend and hold only the new text, so caching a turn costs O(new). A link keeps its
/// ancestors alive after their own entries are evicted; [`Prefix::cost`] charges an entry
/// for everything it reads, and a child reads all of its parent ([`Chain::extend`]), so the
/// budget bounds memory as it did when each request's entries shared one flat buffer. (The
/// ids are a [`TokenIds`], which appends in place instead.)
#[derive(Debug, Default)]
struct Chain {
    parent: Option<(Arc<Chain>, usize)>,
    own: String,
    /// Links from here to the root, this one included.
    links: usize,
}

impl Chain {
    /// A root link holding `own`.
    fn root(own: String) -> Self {
        Self {
            parent: None,
            own,
            links: 1,
        }
    }

    /// Bytes in the whole chain.
    fn len(&self) -> usize {
        self.parent.as_ref().map_or(0, |p| p.1) + self.own.len()
    }

    /// Appends the chain's first `n` bytes (`n <= self.len()`, a char boundary) to `out`.
    fn push_head(&self, n: usize, out: &mut String) {
        let mut segments: [Option<&str>; MAX_LINKS] = [None; MAX_LINKS];
        let (mut count, mut n, mut link) = (0, n, Some(self));
        while let Some(l) = link
            && n > 0
        {
            let before = l.parent.as_ref().map_or(0, |p| p.1);
            if n > before {
                segments[count] = Some(&l.own[..n - before]);
                count += 1;
                n = before;
            }
            link = l.parent.as_ref().map(|p| &*p.0);
        }
        for own in segments[..count].iter().rev().flatten() {
            out.push_str(own);
        }
    }

    /// The chain of the first `n` bytes of `parent` then `own`: a new link when it reads all
    /// of `parent` (a conversation that grew), else (an edited turn, or `parent` has
    /// [`MAX_LINKS`] links already) one root link holding a copy of everything, so a link
    /// never keeps text alive that no entry reads past its own.
    fn extend(parent: &Arc<Self>, n: usize, own: String) -> Self {
        if n == parent.len() && parent.links < MAX_LINKS {
            return Self {
                parent: Some((Arc::clone(parent), n)),
                own,
                links: parent.links + 1,
            };
        }
        let mut all = String::with_capacity(n + own.len());
        parent.push_head(n, &mut all);
        all.push_str(&own);
        Self::root(all)
    }
}

impl Prefix {
    /// Budget charge, token-equivalents (4 bytes): the ids' whole buffer (its capacity, room
    /// for later turns included), the text at 4 bytes per token, and the block keys' buffer
    /// (8 bytes a key, one key per 16 tokens or more, with [`crate::ids::grown`] room).
    /// Charged per entry although entries of one conversation share buffers, so the budget
    /// bounds memory from above.
    fn cost(&self) -> usize {
        let keys = crate::ids::grown(self.ids.len().div_ceil(16));
        self.ids.capacity() + self.text_len.div_ceil(4) + 2 * keys
    }
}

/// The cache of chat prefixes (module doc). Shared by the shards through [`SharedChatCache`].
///
/// Least recently used first, kept lazily: a hit stamps its entry with a new tick and
/// appends `(tick, hash)` to `order`, leaving the entry's older record there, stale (a record
/// is live when its entry still has its tick). Eviction pops records from the front and
/// skips stale ones, so the order evicted is exactly least recently used. A hit costs an
/// append, not two B-tree updates on nodes no recent request touched (those were ~2 % of the
/// samples of a 4,096-worker × 32k-token decision, perf/runs/2026-12-07-decision-trims).
///
/// # Invariants
/// 1. `order`'s ticks ascend; each entry of `entries` has exactly one live record in it;
///    `order` holds at most `2 · entries + COMPACT_SLACK` records after each call
///    (stale ones are dropped when it would hold more: O(1) amortised per append).
/// 2. `held` is the sum of the entries' [`Prefix::cost`], at most `budget` between calls.
#[derive(Debug)]
pub struct ChatCache {
    budget: usize,
    /// Keyed by the prefix's xxh3-128 with std's randomly keyed SipHash on purpose: xxh3 is
    /// unkeyed, so a client could craft bodies whose keys share bucket bits under a
    /// pass-through hasher and turn this map, locked by every shard, into a linear scan.
    entries: HashMap<u128, (Arc<Prefix>, u64)>,
    order: VecDeque<(u64, u128)>,
    held: usize,
    next_tick: u64,
    hits: u64,
    misses: u64,
}

impl Default for ChatCache {
    /// The budget of a model's token prefix cache,
    /// [`kvroute_tokenize::incremental::DEFAULT_CACHE_TOKENS`].
    fn default() -> Self {
        Self::new(kvroute_tokenize::incremental::DEFAULT_CACHE_TOKENS)
    }
}

/// A [`ChatCache`] shared by the shards' tokenizers.
pub type SharedChatCache = Arc<Mutex<ChatCache>>;

impl ChatCache {
    /// An empty cache of at most `budget` token-equivalents ([`Prefix::cost`]); 0 disables it.
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            entries: HashMap::new(),
            order: VecDeque::new(),
            held: 0,
            next_tick: 0,
            hits: 0,
            misses: 0,
        }
    }

    /// [`Self::new`] wrapped for sharing between shards.
    pub fn shared(budget: usize) -> SharedChatCache {
        Arc::new(Mutex::new(Self::new(budget)))
    }

    /// Token-equivalents held now (≤ the budget).
    pub fn held(&self) -> usize {
        self.held
    }

    /// Requests that found a cached prefix, and requests in scope that did not.
    pub fn hits_misses(&self) -> (u64, u64) {
        (self.hits, self.misses)
    }

    /// The longest cached prefix among `cands` (ascending `(bytes, hash)`), looking at most
    /// [`MAX_PROBES`] back from the last.
    fn lookup(&mut self, cands: &[(usize, u128)]) -> Option<Arc<Prefix>> {
        for &(bytes, hash) in cands.iter().rev().take(MAX_PROBES) {
            let Some((p, tick)) = self.entries.get_mut(&hash) else {
                continue;
            };
            if p.bytes != bytes {
                continue;
            }
            let p = Arc::clone(p);
            *tick = self.next_tick;
            self.stamp(hash);
            self.trim();
            self.hits += 1;
            return Some(p);
        }
        self.misses += 1;
        None
    }

    /// Caches `p` under `hash`, evicting the least recently used entries beyond the budget
    /// into `evicted` (the caller drops them once the lock is released).
    fn insert(&mut self, hash: u128, p: Prefix, evicted: &mut Vec<Arc<Prefix>>) {
        if self.budget == 0 || p.cost() > self.budget {
            return;
        }
        if let Some((old, _)) = self.entries.remove(&hash) {
            self.held -= old.cost();
            evicted.push(old);
        }
        self.held += p.cost();
        self.entries.insert(hash, (Arc::new(p), self.next_tick));
        self.stamp(hash);
        while self.held > self.budget {
            let Some((tick, h)) = self.order.pop_front() else {
                break;
            };
            if self.entries.get(&h).is_some_and(|&(_, t)| t == tick)
                && let Some((old, _)) = self.entries.remove(&h)
            {
                self.held -= old.cost();
                evicted.push(old);
            }
        }
        self.trim();
    }

    /// Appends the record of `hash`'s entry, just stamped with `next_tick`, and moves the
    /// tick on.
    fn stamp(&mut self, hash: u128) {
        self.order.push_back((self.next_tick, hash));
        self.next_tick += 1;
    }

    /// Drops the stale records when they outnumber the live ones (invariant 1), once a call's
    /// appends and evictions are done.
    fn trim(&mut self) {
        if self.order.len() > 2 * self.entries.len() + COMPACT_SLACK {
            let entries = &self.entries;
            self.order
                .retain(|(tick, h)| entries.get(h).is_some_and(|&(_, t)| t == *tick));
        }
    }

    /// Checks the invariants (tests only).
    #[cfg(test)]
    fn check(&self) -> Result<(), String> {
        if self.order.len() > 2 * self.entries.len() + COMPACT_SLACK {
            return Err(format!(
                "{} records for {} entries",
                self.order.len(),
                self.entries.len()
            ));
        }
        if !self
            .order
            .iter()
            .zip(self.order.iter().skip(1))
            .all(|(a, b)| a.0 < b.0)
        {
            return Err("order's ticks do not ascend".into());
        }
        let live = self
            .order
            .iter()
            .filter(|(tick, h)| self.entries.get(h).is_some_and(|&(_, t)| t == *tick))
            .count();
        if live != self.entries.len() {
            return Err(format!(
                "{live} live records for {} entries",
                self.entries.len()
            ));
        }
        let sum: usize = self.entries.values().map(|(p, _)| p.cost()).sum();
        if sum != self.held || self.held > self.budget {
            return Err(format!(
                "held {} sum {sum} budget {}",
                self.held, self.budget
            ));
        }
        Ok(())
    }
}

fn lock(cache: &SharedChatCache) -> std::sync::MutexGuard<'_, ChatCache> {
    cache.lock().unwrap_or_else(|p| p.into_inner())
}

/// Candidate message ends of `body`: just past each `}` followed (after whitespace) by `,` or
/// `]`, with the xxh3-128 hash of the bytes before it; only the last [`MAX_PROBES`] are
/// hashed, in one streaming pass.
pub(crate) fn candidates(body: &[u8]) -> Vec<(usize, u128)> {
    let mut ends: Vec<usize> = memchr::memchr_iter(b'}', body)
        .filter(|&i| matches!(body.get(skip_ws(body, i + 1)), Some(b',' | b']')))
        .map(|i| i + 1)
        .collect();
    let from = ends.len().saturating_sub(MAX_PROBES);
    ends.drain(..from);
    // twox-hash's XXH3 picks AVX2 at run time (xxhash-rust's is SSE2 on a baseline build):
    // this pass reads every byte of the body, ~35 KB at turn 10 of an 8k-token chat.
    let mut h = XxHash3_128::new();
    let mut at = 0;
    ends.into_iter()
        .map(|e| {
            h.write(&body[at..e]);
            at = e;
            (e, h.finish_128())
        })
        .collect()
}

/// [`candidates`] computed while a body arrives, so that when its last bytes come only they
/// are left to scan and hash (a gateway reads a 200 KB body in reads of 16 KiB or more; the
/// hash pass over the whole body is the largest step of a long conversation's turn,
/// perf/runs/2026-12-06-decision-anatomy).
///
/// Feed it the body so far after each read ([`Self::feed`]), then the whole body
/// ([`Self::finish`]): the answer equals `candidates(body)` whatever the reads were (the
/// streaming xxh3 of a prefix does not depend on how its bytes were split). The hasher runs
/// up to the scan's frontier as bytes come (every later candidate's prefix contains them);
/// a `}` waits for the next non-whitespace byte to tell whether it ends a candidate. Cost:
/// the bytes once, plus one xxh3 finalization (~40 ns) per candidate end, all of them while
/// the body arrives, not only the last [`MAX_PROBES`] (a content dense in `},` costs one per
/// pair; bounded by the body limit).
#[derive(Clone)]
pub struct PrefixScanner {
    hasher: XxHash3_128,
    /// Bytes hashed so far (the hasher is at `body[..hashed]`).
    hashed: usize,
    /// Bytes scanned for `}` so far.
    scanned: usize,
    /// Just past a `}` whose next non-whitespace byte has not arrived.
    pending: Option<usize>,
    /// The last [`MAX_PROBES`] candidate ends and their hashes, ascending.
    ends: std::collections::VecDeque<(usize, u128)>,
}

/// [`PrefixScanner::new`]: one way to make a scanner, with its ring made at once.
impl Default for PrefixScanner {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for PrefixScanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixScanner")
            .field("hashed", &self.hashed)
            .field("scanned", &self.scanned)
            .field("ends", &self.ends.len())
            .finish()
    }
}

impl PrefixScanner {
    /// A scanner at the start of a body, with room for [`MAX_PROBES`] candidate ends made now
    /// (at a body's first read), not grown while its last read is scanned, which the
    /// decision waits for.
    pub fn new() -> Self {
        Self {
            hasher: XxHash3_128::default(),
            hashed: 0,
            scanned: 0,
            pending: None,
            ends: std::collections::VecDeque::with_capacity(MAX_PROBES),
        }
    }

    /// Scans and hashes what `body` (the body so far: every call's `body` starts with the
    /// previous call's) holds past what earlier calls saw.
    pub fn feed(&mut self, body: &[u8]) {
        loop {
            if let Some(end) = self.pending {
                let next = skip_ws(body, end);
                let Some(&b) = body.get(next) else {
                    return;
                };
                if matches!(b, b',' | b']') {
                    if self.ends.len() == MAX_PROBES {
                        self.ends.pop_front();
                    }
                    self.ends.push_back((end, self.hasher.finish_128()));
                }
                self.pending = None;
            }
            let (to, pending) = match memchr::memchr(b'}', &body[self.scanned..]) {
                Some(k) => (self.scanned + k + 1, Some(self.scanned + k + 1)),
                None => (body.len(), None),
            };
            self.hasher.write(&body[self.hashed..to]);
            (self.hashed, self.scanned, self.pending) = (to, to, pending);
            if pending.is_none() {
                return;
            }
        }
    }

    /// `candidates(body)` for the whole `body` (which starts with every fed slice).
    pub fn finish(mut self, body: &[u8]) -> Vec<(usize, u128)> {
        self.feed(body);
        self.ends.into()
    }
}

/// The xxh3-128 hash of `bytes` (what [`candidates`] computes for a prefix).
fn prefix_hash(bytes: &[u8]) -> u128 {
    XxHash3_128::oneshot(bytes)
}

/// Past the JSON value starting at `b[i]` (structure only: strings, nesting, and scalars up to
/// a delimiter; the caller's JSON parse of the same bytes validates them).
fn skip_value(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match *b.get(j)? {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// Where a chat body's messages are.
#[derive(Debug, PartialEq, Eq)]
struct Layout {
    /// Offset of the `"messages"` key's opening quote.
    key: usize,
    /// Each message's bytes `[start, end)`, from the scan's start on.
    elems: Vec<(usize, usize)>,
    /// Just past the array's `]`.
    end: usize,
}

/// Scans the members of an object from `i` (just past `{` when `first`, else just past a
/// member) to its closing `}` and the end of `b`, noting the `messages` array (`found`: the
/// one already seen); `None` on anything unexpected (an escaped key, a second or a missing
/// `messages`, bytes after the object).
fn scan_members(
    b: &[u8],
    mut i: usize,
    mut first: bool,
    mut found: Option<Layout>,
) -> Option<Layout> {
    loop {
        i = skip_ws(b, i);
        match *b.get(i)? {
            b'}' => {
                return (skip_ws(b, i + 1) == b.len()).then_some(found?);
            }
            b',' if !first => i = skip_ws(b, i + 1),
            _ if first => {}
            _ => return None,
        }
        first = false;
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let key_start = i;
        let key_end = skip_string(b, i)?;
        let key = &b[key_start + 1..key_end - 1];
        if key.contains(&b'\\') {
            return None;
        }
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(b, i + 1);
        if key == b"messages" {
            if found.is_some() || b.get(i) != Some(&b'[') {
                return None;
            }
            let (elems, end) = scan_elements(b, i + 1, true)?;
            found = Some(Layout {
                key: key_start,
                elems,
                end,
            });
            i = end;
        } else {
            i = skip_value(b, i)?;
        }
    }
}

/// The elements of an array from `i` (just past `[` when `first`, else just past an
/// element) to past its `]`: each element must be an object.
fn scan_elements(b: &[u8], mut i: usize, mut first: bool) -> Option<(Vec<(usize, usize)>, usize)> {
    let mut elems = Vec::new();
    loop {
        i = skip_ws(b, i);
        match *b.get(i)? {
            b']' => return Some((elems, i + 1)),
            b',' if !first => i = skip_ws(b, i + 1),
            b'{' if first => {}
            _ => return None,
        }
        first = false;
        if b.get(i) != Some(&b'{') {
            return None;
        }
        let end = skip_value(b, i)?;
        elems.push((i, end));
        i = end;
    }
}

/// The layout of a whole body (a JSON object with one `messages` array of objects).
fn scan_body(b: &[u8]) -> Option<Layout> {
    let i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    scan_members(b, i + 1, true, None)
}

/// The layout of the bytes after a cached prefix (`b[..p]` ends just past a message of the
/// `messages` array whose key is at `key`): the new messages and the rest of the object.
fn scan_rest(b: &[u8], p: usize, key: usize) -> Option<Layout> {
    let (elems, end) = scan_elements(b, p, false)?;
    let layout = Layout { key, elems, end };
    scan_members(b, end, false, Some(layout))
}

/// The top-level fields besides `messages`, as one small object: the head before the key,
/// `"messages":null`, and the tail after the array.
fn other_fields(b: &[u8], l: &Layout) -> Vec<u8> {
    let mut v = Vec::with_capacity(l.key + 16 + b.len() - l.end);
    v.extend_from_slice(&b[..l.key]);
    v.extend_from_slice(b"\"messages\":null");
    v.extend_from_slice(&b[l.end..]);
    v
}

/// A body's messages in scope, parsed: each message's native form.
struct Parsed<'a> {
    msgs: Vec<PlainMessage<'a>>,
    opts: RenderOptions,
}

/// Parses the messages `l.elems` of `b` (`None`: out of scope), with `opts` the body's.
fn parse_in_scope<'a>(b: &'a [u8], l: &Layout, opts: RenderOptions) -> Option<Parsed<'a>> {
    let msgs = l
        .elems
        .iter()
        .map(|&(s, e)| PlainMessage::parse(&b[s..e]))
        .collect::<Option<Vec<_>>>()?;
    Some(Parsed { msgs, opts })
}

/// Other-fields objects ([`other_fields`]) a shard remembers, with what they parse to.
pub(crate) const OTHERS_MEMO: usize = 8;

/// The last [`OTHERS_MEMO`] other-fields objects a shard parsed on the hit path, each with
/// its render options and the key its fields make (`messages` aside), replaced round robin.
///
/// Why: a chat client sends the same fields besides `messages` every turn (model, sampling
/// parameters), and parsing them twice per turn (the render options, then the key's fields)
/// cost ~1.7 µs of a 4,096-worker × 32k-token decision, on serde code the body's scan had
/// made cold (perf/runs/2026-12-07-others-memo). Exact: both parses are functions of the
/// bytes alone, which are compared whole.
#[derive(Debug, Default)]
pub(crate) struct OthersMemo {
    slots: Vec<(Box<[u8]>, RenderOptions, RouteKey)>,
    next: usize,
}

impl OthersMemo {
    /// The options and key of `others`, if remembered.
    fn get(&self, others: &[u8]) -> Option<(RenderOptions, RouteKey)> {
        self.slots
            .iter()
            .find(|(b, _, _)| **b == *others)
            .map(|(_, o, k)| (*o, k.clone()))
    }

    /// Remembers `others` with its options and key, in place of the oldest when full.
    fn put(&mut self, others: &[u8], opts: RenderOptions, key: &RouteKey) {
        let slot = (Box::from(others), opts, key.clone());
        if self.slots.len() < OTHERS_MEMO {
            self.slots.push(slot);
        } else {
            self.slots[self.next] = slot;
            self.next = (self.next + 1) % OTHERS_MEMO;
        }
    }
}

/// The model's tokenizer when its chat template is rendered natively.
fn native(t: Option<&mut IncrementalTokenizer>) -> Option<&mut IncrementalTokenizer> {
    t.filter(|t| {
        t.tokenizer()
            .chat_template()
            .is_some_and(|c| c.is_native_qwen3())
    })
}

impl ShardTokenizers {
    /// The hit path (module doc, steps 1–4): `None` when no cached prefix applies or anything
    /// is out of scope; the caller then takes the full path, which parses again and reports
    /// errors. `tokenize(model)` says whether the request is to be tokenized at all (a known
    /// model); when it says no, the key is returned in text mode. Else the key carries its
    /// ids and no text, and [`Attached`] has the prefix tokens reused and the request's own
    /// entries, to be applied once it has left ([`ChatInsert`]).
    /// `cands` are [`candidates`] of `body`.
    pub(crate) fn route_cached(
        &mut self,
        body: &[u8],
        cands: &[(usize, u128)],
        tokenize: &dyn Fn(&str) -> bool,
    ) -> Option<Result<(RouteKey, Attached), CoreError>> {
        let prefix = lock(&self.chat).lookup(cands)?;
        let layout = scan_rest(body, prefix.bytes, prefix.key)?;
        let others = other_fields(body, &layout);
        let memo = self.others.get(&others);
        let opts = match &memo {
            Some((opts, _)) => *opts,
            None => RenderOptions::parse(&others)?,
        };
        let parsed = parse_in_scope(body, &layout, opts)?;
        if parsed.msgs.is_empty() && prefix.last_wrappable {
            return None;
        }
        let mut key = match memo {
            Some((_, key)) => key,
            None => {
                let mut fields = parse_fields(&others).ok()?;
                fields.messages = Some(Messages::List(String::new(), Vec::new()));
                match key_from_fields(Endpoint::ChatCompletions, fields) {
                    Ok(key) => {
                        self.others.put(&others, opts, &key);
                        key
                    }
                    Err(e) => return Some(Err(e)),
                }
            }
        };
        // The new messages' routing text only: a key that gets ids carries no text, so the
        // cached text is copied out only for a key left in text mode.
        let mut new_text = String::with_capacity(body.len() - prefix.bytes);
        let first = prefix.messages;
        let count = first + parsed.msgs.len();
        let mut b = Boundaries::default();
        let last_query = flatten(
            &parsed,
            &layout,
            first,
            prefix.last_query,
            (prefix.text_len, Some(&mut new_text)),
            &mut b,
        );
        let whole_text = |new: &str| {
            let mut text = String::with_capacity(prefix.text_len + new.len());
            prefix.text.push_head(prefix.text_len, &mut text);
            text.push_str(new);
            text
        };
        if !tokenize(&key.model) {
            key.text = whole_text(&new_text);
            return Some(Ok((key, Attached::default())));
        }
        let t = native(self.for_model(&key.model))?;
        if t.cache_id() != prefix.tokenizer {
            return None;
        }
        // The new messages' ids, then the generation prompt's; the key's ids are the cached
        // prefix's then these, copied once into their shared buffer.
        let mut new_ids = Vec::with_capacity((body.len() - prefix.bytes) / 3 + 8);
        let mut buf = String::new();
        let tok = t.tokenizer();
        for (j, m) in parsed.msgs.iter().enumerate() {
            let wrapped = native::think_wrapped(m, first + j, count, last_query);
            tok.encode_message_into(m, wrapped, &mut buf, &mut new_ids)
                .ok()?;
            b.push_tokens(prefix.ids.len() + new_ids.len(), wrapped);
        }
        tok.encode_generation_into(parsed.opts, &mut buf, &mut new_ids)
            .ok()?;
        let slot = Arc::new(OnceLock::new());
        let reuse = prefix
            .block_keys
            .get()
            .map(|k| (Arc::clone(k), prefix.ids.len()));
        key.block_key_memo = BlockKeyMemo::new(reuse, Arc::clone(&slot));
        // In the buffer of the conversation's ids when this request extends its end (module
        // doc of `crate::ids`): no copy of the cached ids.
        let ids = prefix.ids.head_then(prefix.ids.len(), &new_ids);
        if ids.is_empty() {
            key.text = whole_text(&new_text);
        } else {
            key.input_ids = Some(ids.clone());
            key.token_source = TokenSource::Prompt;
        }
        let cached = Cached {
            key: prefix.key,
            tokenizer: t.cache_id(),
            block_keys: slot,
            ids,
            text: Chain::extend(&prefix.text, prefix.text_len, new_text),
        };
        let attached = Attached {
            reused_tokens: prefix.ids.len(),
            chat_insert: entries(&self.chat, body, cands, &b, first, cached),
            ..Attached::default()
        };
        Some(Ok((key, attached)))
    }

    /// The miss path for a chat `body` that `key` was parsed from (by
    /// [`crate::route_key::route_key`], so the body is valid): the template text rendered
    /// message by message, the whole prompt through the incremental tokenizer (as
    /// [`ShardTokenizers::attach`] does), and the last message ends cached (see
    /// [`MAX_SUFFIX_BYTES`]). Returns the tokens reused and the request's entries, to be
    /// applied once it has left ([`ChatInsert`]), or `None` when out of scope (the caller
    /// then renders through the chat template as before). `cands` are [`candidates`] of `body`.
    pub(crate) fn route_miss(
        &mut self,
        body: &[u8],
        cands: &[(usize, u128)],
        key: &mut RouteKey,
    ) -> Option<Result<(usize, Option<ChatInsert>), TokenizeError>> {
        let layout = scan_body(body)?;
        let others = other_fields(body, &layout);
        let parsed = parse_in_scope(body, &layout, RenderOptions::parse(&others)?)?;
        let count = parsed.msgs.len();
        if count == 0 {
            return None;
        }
        let t = native(self.for_model(&key.model))?;
        let mut b = Boundaries::default();
        let last_query_all = flatten(&parsed, &layout, 0, None, (0, None), &mut b);
        // The same flattening as route_key's (a check, not an expectation of a difference).
        if b.text_len.last() != Some(&key.text.len()) {
            return None;
        }
        let mut rendered = String::new();
        let mut ends = Vec::with_capacity(count);
        let mut wrapped = Vec::with_capacity(count);
        for (j, m) in parsed.msgs.iter().enumerate() {
            let w = native::think_wrapped(m, j, count, last_query_all);
            native::render_message(&mut rendered, m, w);
            ends.push(rendered.len());
            wrapped.push(w);
        }
        native::render_generation(&mut rendered, parsed.opts);
        // The whole prompt through the incremental tokenizer, as `attach` tokenizes it (a
        // growing single-message prompt reuses its text anchors there).
        let (ids, reused) = match t.encode(&rendered, key.namespace) {
            Ok(e) => (e.ids, e.reused_tokens),
            Err(e) => return Some(Err(e)),
        };
        // Tokens up to each of the last message ends, from the end: at a template cut the ids
        // of the whole are the ids of the part before it then those of the part after it.
        // Only short suffixes are tokenized again for this, so a long last message is not
        // paid twice; a message end without a count is not cached.
        let mut tokens = vec![None; count];
        for j in (count.saturating_sub(ENTRIES_PER_REQUEST)..count).rev() {
            let suffix = &rendered[ends[j]..];
            if suffix.len() > MAX_SUFFIX_BYTES {
                break;
            }
            match t.tokenizer().try_encode(suffix) {
                Ok(v) if v.len() <= ids.len() => tokens[j] = Some(ids.len() - v.len()),
                _ => break,
            }
        }
        for (j, n) in tokens.iter().enumerate() {
            b.push_tokens(n.unwrap_or(0), wrapped[j] || n.is_none());
        }
        let slot = Arc::new(OnceLock::new());
        key.block_key_memo = BlockKeyMemo::new(None, Arc::clone(&slot));
        // One copy, with room for the next turns ([`TokenIds::head_then`]).
        let ids = TokenIds::with_headroom(&ids);
        let text = if ids.is_empty() {
            key.text.clone()
        } else {
            key.input_ids = Some(ids.clone());
            key.token_source = TokenSource::Prompt;
            std::mem::take(&mut key.text)
        };
        let cached = Cached {
            key: layout.key,
            tokenizer: t.cache_id(),
            block_keys: slot,
            ids,
            text: Chain::root(text),
        };
        Some(Ok((
            reused,
            entries(&self.chat, body, cands, &b, 0, cached),
        )))
    }
}

/// What a request's cached prefixes share: the `messages` key's offset, the tokenizer, and
/// the ids and routing text up to (at least) its last cached message end.
struct Cached {
    key: usize,
    tokenizer: usize,
    block_keys: Arc<OnceLock<Arc<BlockKeys>>>,
    ids: TokenIds,
    text: Chain,
}

/// Per message of a request (from its first new one): where it ends in the body, and the
/// ids and routing text up to its end.
#[derive(Default)]
struct Boundaries {
    body_end: Vec<usize>,
    tokens: Vec<usize>,
    text_len: Vec<usize>,
    /// Not to be cached: the message was rendered in a `<think>` block
    /// ([`native::think_wrapped`]), or (on a miss) its end's token count is unknown.
    skip: Vec<bool>,
    last_query: Vec<Option<usize>>,
    /// The message would be wrapped if it were a body's last.
    wrappable: Vec<bool>,
}

impl Boundaries {
    fn push_text(
        &mut self,
        end: usize,
        text: usize,
        last_query: Option<usize>,
        m: &PlainMessage<'_>,
        index: usize,
    ) {
        self.body_end.push(end);
        self.text_len.push(text);
        self.last_query.push(last_query);
        self.wrappable
            .push(m.role == "assistant" && last_query.is_some_and(|q| index > q));
    }

    fn push_tokens(&mut self, tokens: usize, skip: bool) {
        self.tokens.push(tokens);
        self.skip.push(skip);
    }
}

/// The routing text of messages `parsed.msgs` (message `first + j` each) as
/// [`crate::route_key::route_key`] flattens them: `<|role|>` + content. `text` is
/// `(bytes of routing text before them, the string to append theirs to, if any)` (a message
/// in scope has string content, so no media keys). Notes each message end in `b`, its text
/// length counted from the bytes before; returns the index of the last real user query,
/// `last_query` if none is new.
fn flatten(
    parsed: &Parsed<'_>,
    layout: &Layout,
    first: usize,
    mut last_query: Option<usize>,
    (mut len, mut text): (usize, Option<&mut String>),
    b: &mut Boundaries,
) -> Option<usize> {
    for (j, (m, &(_, end))) in parsed.msgs.iter().zip(&layout.elems).enumerate() {
        if let Some(t) = text.as_mut() {
            t.push_str("<|");
            t.push_str(&m.role);
            t.push_str("|>");
            t.push_str(&m.content);
        }
        len += 4 + m.role.len() + m.content.len();
        if m.is_query() {
            last_query = Some(first + j);
        }
        b.push_text(end, len, last_query, m, first + j);
    }
    last_query
}

/// The entries of the last [`ENTRIES_PER_REQUEST`] message ends of `b` (boundary `j` is the
/// end of message `first + j`), except one ending with a wrapped message, to be cached by
/// [`ChatInsert::apply`] (`None` when there are none: a body whose messages were all
/// cached). Hashes come from `cands` ([`candidates`] of `body`) where they are there.
fn entries(
    cache: &SharedChatCache,
    body: &[u8],
    cands: &[(usize, u128)],
    b: &Boundaries,
    first: usize,
    c: Cached,
) -> Option<ChatInsert> {
    let n = b.body_end.len();
    debug_assert!(b.tokens.iter().all(|&t| t <= c.ids.len()));
    debug_assert!(b.text_len.iter().all(|&t| t <= c.text.len()));
    let text = Arc::new(c.text);
    let mut out = Vec::with_capacity(ENTRIES_PER_REQUEST);
    for j in n.saturating_sub(ENTRIES_PER_REQUEST)..n {
        if b.skip[j] {
            continue;
        }
        let bytes = b.body_end[j];
        let hash = match cands.binary_search_by_key(&bytes, |&(e, _)| e) {
            Ok(i) => cands[i].1,
            Err(_) => prefix_hash(&body[..bytes]),
        };
        let p = Prefix {
            bytes,
            key: c.key,
            tokenizer: c.tokenizer,
            messages: first + j + 1,
            last_query: b.last_query[j],
            last_wrappable: b.wrappable[j],
            ids: c.ids.head(b.tokens[j]),
            text: Arc::clone(&text),
            text_len: b.text_len[j],
            block_keys: Arc::clone(&c.block_keys),
        };
        out.push((hash, p));
    }
    (!out.is_empty()).then(|| ChatInsert {
        cache: Arc::clone(cache),
        entries: out,
    })
}

/// A routed request's chat-prefix entries (the state after each of its last messages, what
/// its next turn reuses), made while it was tokenized and cached only by [`Self::apply`].
///
/// Why apart: the inserts (the shared cache's lock, its LRU bookkeeping, and the evictions
/// they cause, which free whole conversations' buffers) are none of this request's business,
/// only its next turn's, and that turn comes after this one's answer. So a gateway applies
/// them once the request has left for its worker, off the path the request waits on, as it
/// records the routing decision ([`crate::policy::Router::record`]).
/// Dropping it unapplied loses nothing but the entries (the next turn then tokenizes its
/// whole conversation again).
#[must_use = "a chat insert caches nothing until it is applied"]
#[derive(Debug)]
pub struct ChatInsert {
    cache: SharedChatCache,
    entries: Vec<(u128, Prefix)>,
}

impl ChatInsert {
    /// Caches the entries (least recently used ones make room, [`ChatCache`]). The entries
    /// they evict are freed after the cache's lock is released.
    pub fn apply(self) {
        let mut evicted = Vec::new();
        let mut cache = lock(&self.cache);
        for (h, p) in self.entries {
            cache.insert(h, p, &mut evicted);
        }
        drop(cache);
        drop(evicted);
    }

    /// Message ends it caches (at least 1: a request with none has no `ChatInsert`).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route_key::route_key;
    use crate::tokens::Tokenizers;
    use kvroute_tokenize::Tokenizer;
    use proptest::prelude::*;
    use serde_json::{Value, json};
    use std::sync::OnceLock;

    fn qwen() -> &'static Tokenizer {
        static T: OnceLock<Tokenizer> = OnceLock::new();
        T.get_or_init(|| Tokenizer::qwen3().unwrap())
    }

    fn shard(budget: usize) -> ShardTokenizers {
        Tokenizers::new(Some(qwen().clone()), Vec::new(), budget).for_shard()
    }

    /// The full path: route_key then attach, with its own tokenizers; a key with ids then has
    /// no text, as `ShardTokenizers::route` documents.
    fn reference(r: &mut ShardTokenizers, body: &[u8]) -> Result<(RouteKey, bool), CoreError> {
        let mut key = route_key(Endpoint::ChatCompletions, body)?;
        let a = r.attach(Endpoint::ChatCompletions, body, None, &mut key);
        if key.input_ids.is_some() {
            key.text.clear();
        }
        Ok((key, a.prompt_error.is_some()))
    }

    fn routed(s: &mut ShardTokenizers, body: &[u8]) -> Result<(RouteKey, Attached2), CoreError> {
        let (key, a) = s.route(Endpoint::ChatCompletions, body, None, &|_| true)?;
        Ok((
            key,
            Attached2 {
                reused: a.reused_tokens,
                failed: a.prompt_error.is_some(),
            },
        ))
    }

    struct Attached2 {
        reused: usize,
        failed: bool,
    }

    fn stats(s: &ShardTokenizers) -> (u64, u64) {
        lock(&s.chat).hits_misses()
    }

    #[test]
    fn a_chain_reads_every_head_of_its_links() {
        // Links of 3, 0, 4 and 2 bytes, then an edited link (a root copy): every head of each
        // against the flat text.
        let root = Arc::new(Chain::root("abc".into()));
        let empty = Arc::new(Chain::extend(&root, 3, String::new()));
        let four = Arc::new(Chain::extend(&empty, 3, "defg".into()));
        let two = Arc::new(Chain::extend(&four, 7, "hi".into()));
        let edited = Arc::new(Chain::extend(&two, 5, "X".into()));
        assert_eq!((two.links, edited.links), (4, 1));
        for (chain, flat) in [
            (&root, "abc"),
            (&empty, "abc"),
            (&four, "abcdefg"),
            (&two, "abcdefghi"),
            (&edited, "abcdeX"),
        ] {
            assert_eq!(chain.len(), flat.len());
            for n in 0..=flat.len() {
                let mut out = String::from(">");
                chain.push_head(n, &mut out);
                assert_eq!(out, format!(">{}", &flat[..n]), "n {n}");
            }
        }
    }

    #[test]
    fn candidate_hashes_are_xxh3_128_of_each_prefix() {
        // Long messages, so that the streaming hash crosses its 1 KB blocks and stripes
        // between candidates and the SIMD path runs; xxhash-rust's one-shot is the reference.
        let msgs: Vec<_> = (0..12)
            .map(|i| json!({"role": "user", "content": "word ".repeat(37 * i + 1)}))
            .collect();
        let body = serde_json::to_vec(&json!({"model": "m", "messages": msgs})).unwrap();
        let cands = candidates(&body);
        assert_eq!(cands.len(), 12);
        for &(end, hash) in &cands {
            assert_eq!(body[end - 1], b'}');
            assert_eq!(hash, xxhash_rust::xxh3::xxh3_128(&body[..end]), "end {end}");
            assert_eq!(hash, prefix_hash(&body[..end]));
        }
    }

    #[test]
    fn a_hit_left_in_text_mode_has_the_whole_text_and_a_token_hit_none() {
        let mut s = shard(1 << 20);
        let sys = json!({"role": "system", "content": "Be brief."});
        let q1 = json!({"role": "user", "content": "Hi"});
        let b1 = serde_json::to_vec(&json!({"model": "m", "messages": [sys, q1]})).unwrap();
        routed(&mut s, &b1).unwrap();
        let a = json!({"role": "assistant", "content": "Hello!"});
        let q2 = json!({"role": "user", "content": "2+2?"});
        let b2 = serde_json::to_vec(&json!({"model": "m", "messages": [sys, q1, a, q2]})).unwrap();
        let asked = std::cell::RefCell::new(Vec::new());
        let no = |m: &str| {
            asked.borrow_mut().push(m.to_string());
            false
        };
        let (text_key, _) = s.route(Endpoint::ChatCompletions, &b2, None, &no).unwrap();
        assert_eq!(stats(&s), (1, 1), "a hit");
        assert_eq!(*asked.borrow(), ["m"]);
        assert_eq!(text_key, route_key(Endpoint::ChatCompletions, &b2).unwrap());
        assert_eq!(
            text_key.text,
            "<|system|>Be brief.<|user|>Hi<|assistant|>Hello!<|user|>2+2?"
        );
        let (token_key, a2) = routed(&mut s, &b2).unwrap();
        assert_eq!(stats(&s), (2, 1));
        assert!(a2.reused > 0);
        assert_eq!(
            (token_key.text.as_str(), token_key.token_source),
            ("", TokenSource::Prompt)
        );
        let mut r = shard(0);
        assert_eq!((token_key, false), reference(&mut r, &b2).unwrap());
    }

    #[test]
    fn second_turn_reuses_the_first_and_equals_the_full_path() {
        let (mut s, mut r) = (shard(1 << 20), shard(0));
        let sys = json!({"role": "system", "content": "Be brief."});
        let q1 = json!({"role": "user", "content": "Hi"});
        let turn1 = json!({"messages": [sys, q1], "model": "m", "stream": true});
        let b1 = serde_json::to_vec(&turn1).unwrap();
        let (k1, a1) = routed(&mut s, &b1).unwrap();
        assert_eq!((a1.reused, a1.failed), (0, false));
        assert_eq!(stats(&s), (0, 1));
        let want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
                    <|im_start|>assistant\n";
        assert_eq!(k1.input_ids.as_deref(), Some(&qwen().encode(want)[..]));
        assert_eq!((k1.clone(), false), reference(&mut r, &b1).unwrap());
        let a = json!({"role": "assistant", "content": "Hello!"});
        let q2 = json!({"role": "user", "content": "2+2?"});
        let turn2 = json!({"messages": [sys, q1, a, q2], "model": "m", "stream": true});
        let b2 = serde_json::to_vec(&turn2).unwrap();
        let (k2, a2) = routed(&mut s, &b2).unwrap();
        assert_eq!(stats(&s), (1, 1));
        // Reused: the ids of both turn-1 messages, i.e. all of turn 1 but its generation prompt.
        let generation = qwen().encode("<|im_start|>assistant\n").len();
        assert_eq!(a2.reused, k1.input_ids.as_ref().unwrap().len() - generation);
        // Turn 2's ids extend turn 1's buffer in place (the assistant message starts with the
        // generation prompt turn 1 wrote there), and turn 1's key still reads its own.
        let (ids1, ids2) = (
            k1.input_ids.as_ref().unwrap(),
            k2.input_ids.as_ref().unwrap(),
        );
        assert!(ids2.shares_buffer(ids1));
        assert_eq!(ids1[..], qwen().encode(want)[..]);
        assert_eq!((k2.clone(), false), reference(&mut r, &b2).unwrap());
        // An edited turn 2 (another question) branches into a buffer of its own, and leaves
        // turn 2's ids as they were.
        let q2b = json!({"role": "user", "content": "3+3?"});
        let turn2b = json!({"messages": [sys, q1, a, q2b], "model": "m", "stream": true});
        let b2b = serde_json::to_vec(&turn2b).unwrap();
        let (k2b, _) = routed(&mut s, &b2b).unwrap();
        assert!(!k2b.input_ids.as_ref().unwrap().shares_buffer(ids1));
        assert_eq!((k2b, false), reference(&mut r, &b2b).unwrap());
        assert_eq!((k2, false), reference(&mut r, &b2).unwrap());
    }

    #[test]
    fn a_turns_entries_are_cached_only_when_applied() {
        let mut s = shard(1 << 20);
        let sys = json!({"role": "system", "content": "Be brief."});
        let q1 = json!({"role": "user", "content": "Hi"});
        let a = json!({"role": "assistant", "content": "Hello!"});
        let q2 = json!({"role": "user", "content": "2+2?"});
        let b1 = serde_json::to_vec(&json!({"messages": [sys, q1], "model": "m"})).unwrap();
        let b2 = serde_json::to_vec(&json!({"messages": [sys, q1, a, q2], "model": "m"})).unwrap();
        let route = |s: &mut ShardTokenizers, b: &[u8]| {
            s.route_scanned(Endpoint::ChatCompletions, b, None, &|_| true, None)
                .unwrap()
        };
        // Turn 1 (a miss) makes one entry per message end, none cached yet.
        let (_, mut a1) = route(&mut s, &b1);
        let insert = a1
            .chat_insert
            .take()
            .expect("a chat in scope makes entries");
        assert_eq!(insert.len(), 2);
        let held = lock(&s.chat).held();
        assert_eq!((held, stats(&s)), (0, (0, 1)));
        // Turn 2 before them: a miss, and its own entries are not cached either.
        let (k2_early, a2_early) = route(&mut s, &b2);
        assert_eq!(stats(&s), (0, 2));
        assert_eq!(a2_early.chat_insert.map(|i| i.len()), Some(3));
        insert.apply();
        lock(&s.chat).check().unwrap();
        // After them: turn 2 reuses both of turn 1's messages, with the same key.
        let (k2, a2) = route(&mut s, &b2);
        assert_eq!(stats(&s), (1, 2));
        let turn1 = qwen()
            .encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
        assert_eq!(a2.reused_tokens, turn1.len());
        assert_eq!(k2.input_ids.as_ref().unwrap()[..turn1.len()], turn1[..]);
        assert_eq!(k2, k2_early);
        // Once turn 2's own entries are in, the same body again is all cached: nothing to
        // insert, so no `ChatInsert` (and no reference to the shared cache) is made.
        a2.chat_insert.expect("turn 2 had new messages").apply();
        let (k2_again, a2_again) = route(&mut s, &b2);
        assert_eq!(stats(&s), (2, 2));
        assert!(a2_again.chat_insert.is_none());
        assert_eq!(k2_again, k2);
    }

    #[test]
    fn remembered_other_fields_give_each_body_its_own_key() {
        let (mut s, mut r) = (shard(1 << 20), shard(0));
        // Ten conversations whose fields besides `messages` differ (model, stream, salt),
        // more than the memo holds, each routed over three turns, interleaved.
        let others = |c: usize| {
            let (model, salt) = (format!("m{}", c % 5), format!("s{c}"));
            json!({"model": model, "stream": c.is_multiple_of(2), "cache_salt": salt})
        };
        let body = |c: usize, turns: usize| {
            let mut v = others(c);
            let mut messages =
                vec![json!({"role": "user", "content": format!("conversation {c}")})];
            for t in 1..turns {
                messages.push(json!({"role": "assistant", "content": format!("reply {t}")}));
                messages.push(json!({"role": "user", "content": format!("question {t}")}));
            }
            v["messages"] = Value::Array(messages);
            serde_json::to_vec(&v).unwrap()
        };
        for turns in 1..=3 {
            for c in 0..10 {
                let b = body(c, turns);
                let (k, _) = routed(&mut s, &b).unwrap();
                assert_eq!((k, false), reference(&mut r, &b).unwrap(), "{c} {turns}");
            }
        }
        assert_eq!(stats(&s), (20, 10));
        assert_eq!(s.others.slots.len(), OTHERS_MEMO);
        // A remembered object answers for the same bytes only: the same fields spaced
        // otherwise (after `messages`, so the cached prefix still applies) parse again, to
        // the same key.
        let b = body(9, 4);
        let (k, _) = routed(&mut s, &b).unwrap();
        assert_eq!(k.model, "m4");
        let spaced = String::from_utf8(b.clone())
            .unwrap()
            .replace("\"model\":\"m4\"", "\"model\": \"m4\"");
        assert_ne!(spaced.as_bytes(), &b[..]);
        let before = s.others.slots.clone();
        let (k2, _) = routed(&mut s, spaced.as_bytes()).unwrap();
        assert_eq!(stats(&s), (22, 10));
        assert_ne!(s.others.slots, before);
        assert_eq!(
            (k2.clone(), false),
            reference(&mut r, spaced.as_bytes()).unwrap()
        );
        assert_eq!(k2, k);
    }

    #[test]
    fn a_turn_reuses_the_block_keys_of_the_turn_before_at_their_block_size_only() {
        use crate::config::Config;
        use crate::policy::Router;
        let mut s = shard(1 << 20);
        let m = |role: &str, c: String| json!({"role": role, "content": c});
        let long: String = (0..300).map(|i| format!(" w{}", i % 50)).collect();
        let mut msgs = vec![m("system", long), m("user", "first question".into())];
        let r16 = Router::new(&Config {
            block_size: 16,
            ..Config::default()
        });
        let r8 = Router::new(&Config {
            block_size: 8,
            ..Config::default()
        });
        let (mut known, mut keys16, mut shared) = (Vec::new(), Vec::new(), Vec::new());
        for turn in 0..4 {
            let b = serde_json::to_vec(&json!({"model": "m", "cache_salt": "x", "messages": msgs}))
                .unwrap();
            let (key, _) = routed(&mut s, &b).unwrap();
            let ids = key.input_ids.as_deref().unwrap();
            known.push(
                key.block_key_memo
                    .known(key.namespace, 16)
                    .map_or(0, |k| k.len()),
            );
            // The 8-token router never finds keys of its block size in the memo (r16 fills
            // it first), and computes them all; both equal the whole computation.
            assert!(key.block_key_memo.known(key.namespace, 8).is_none());
            assert!(key.block_key_memo.known(key.namespace ^ 1, 16).is_none());
            let f16 = r16.request(&key);
            let f8 = r8.request(&key);
            // A later turn's keys extend the turn before's in its buffer (`crate::ids`).
            if let Some(before) = keys16.last() {
                shared.push(f16.block_keys.shares_buffer(before));
            }
            keys16.push(f16.block_keys.clone());
            assert_eq!(
                *f16.block_keys,
                *kvroute_index::keys::block_keys_in(key.namespace, ids, 16)
            );
            assert_eq!(
                *f8.block_keys,
                *kvroute_index::keys::block_keys_in(key.namespace, ids, 8)
            );
            msgs.push(m("assistant", format!("answer {turn}")));
            msgs.push(m("user", format!("question {turn}")));
        }
        // Turn 1 is a miss (nothing known); every later turn knows at least the blocks of the
        // long system message (~300 tokens / 16).
        assert_eq!(known[0], 0);
        assert!(known[1..].iter().all(|&k| k >= 300 / 16), "{known:?}");
        assert_eq!(shared, [true; 3]);
    }

    #[test]
    fn a_grown_single_message_still_reuses_its_text_anchors() {
        // Replayed traces (Mooncake) send each turn as one message extending the last: no
        // message end is shared, so the chat prefix cache misses and the incremental
        // tokenizer's text anchors must still reuse the old text.
        let (mut s, mut r) = (shard(1 << 20), shard(0));
        let words: String = (0..400)
            .map(|i| format!("word{} and more ", i % 37))
            .collect();
        let one = |t: &str| {
            serde_json::to_vec(&json!({"messages": [{"role": "user", "content": t}]})).unwrap()
        };
        let (_, a1) = routed(&mut s, &one(&words)).unwrap();
        assert_eq!(a1.reused, 0);
        let grown = format!("{words} then a new question?");
        let (k2, a2) = routed(&mut s, &one(&grown)).unwrap();
        assert_eq!(stats(&s), (0, 2));
        assert!(a2.reused > 1000, "{}", a2.reused);
        assert_eq!((k2, false), reference(&mut r, &one(&grown)).unwrap());
    }

    #[test]
    fn a_broken_suffix_gets_the_full_paths_error() {
        let mut s = shard(1 << 20);
        let m = |c: &str| json!({"role": "user", "content": c});
        let b1 = serde_json::to_vec(&json!({"model": "m", "messages": [m("a"), m("b")]})).unwrap();
        routed(&mut s, &b1).unwrap();
        let good = serde_json::to_vec(&json!({"model": "m", "messages": [m("a"), m("b"), m("c")]}))
            .unwrap();
        let cut = good.len() - 2; // `…"c"}]}` → `…"c"}` + each tail
        for tail in [
            &b"]}"[..],
            b"}",
            b"},]}",
            b"}] x",
            b"},{\"role\":1}]}",
            b"}],\"model\":}",
        ] {
            let mut body = good[..cut].to_vec();
            body.extend_from_slice(tail);
            let got = routed(&mut s, &body).map(|(k, _)| k);
            let want = route_key(Endpoint::ChatCompletions, &body);
            match (got, want) {
                (Ok(g), Ok(w)) => {
                    assert_eq!(g.text, w.text, "{}", String::from_utf8_lossy(&body))
                }
                (Err(g), Err(w)) => assert_eq!(g.to_string(), w.to_string()),
                (g, w) => panic!(
                    "{:?} vs {:?} for {}",
                    g.is_ok(),
                    w.is_ok(),
                    String::from_utf8_lossy(&body)
                ),
            }
        }
    }

    #[test]
    fn an_assistant_turn_that_would_be_wrapped_is_not_reused_as_the_last() {
        // Turn 1 ends with an assistant message after the query: rendered in a <think> block,
        // so its end is not cached; a prefix ending just before it is.
        let (mut s, mut r) = (shard(1 << 20), shard(0));
        let u = json!({"role": "user", "content": "q"});
        let a = json!({"role": "assistant", "content": "\n\npartial"});
        for body in [
            json!({"messages": [u, a]}),
            json!({"messages": [u, a]}),
            json!({"messages": [u, a, u]}),
            json!({"messages": [u, a]}),
        ] {
            let b = serde_json::to_vec(&body).unwrap();
            let (k, _) = routed(&mut s, &b).unwrap();
            assert_eq!((k, false), reference(&mut r, &b).unwrap(), "{body}");
        }
    }

    #[test]
    fn layout_of_a_body() {
        let b =
            br#" { "model" : "m", "messages" : [ {"a":"},{"} , {"b":[1,{"c":"]"}]} ] , "x":[]} "#;
        let l = scan_body(b).unwrap();
        assert_eq!(&b[l.key..l.key + 10], b"\"messages\"");
        let elems: Vec<&[u8]> = l.elems.iter().map(|&(s, e)| &b[s..e]).collect();
        assert_eq!(elems, [&br#"{"a":"},{"}"#[..], br#"{"b":[1,{"c":"]"}]}"#]);
        assert_eq!(&b[l.end - 1..l.end], b"]");
        for bad in [
            &br#"{"messages":[1]}"#[..],
            br#"{"messages":[{}],"messages":[]}"#,
            br#"{"m\u0065ssages":[{}]}"#,
            br#"{"x":1}"#,
            br#"{"messages":[{}]} x"#,
        ] {
            assert_eq!(scan_body(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn the_budget_evicts_least_recently_used() {
        let mut s = shard(40);
        let mut r = shard(0);
        for i in 0..30 {
            let body = json!({"messages": [{"role": "user", "content": format!("conversation {i} says hello")}]});
            let b = serde_json::to_vec(&body).unwrap();
            let (k, _) = routed(&mut s, &b).unwrap();
            assert_eq!((k, false), reference(&mut r, &b).unwrap());
            let c = lock(&s.chat);
            c.check().unwrap();
            assert!(c.held() <= 40);
        }
    }

    /// A cache entry of `text` bytes of routing text and no ids (its cost is set by `text`),
    /// covering `bytes` body bytes (an entry's name in these tests).
    fn entry(bytes: usize, text: usize) -> Prefix {
        Prefix {
            bytes,
            key: 0,
            tokenizer: 0,
            messages: 1,
            last_query: None,
            last_wrappable: false,
            ids: TokenIds::default(),
            text: Arc::new(Chain::root("x".repeat(text))),
            text_len: text,
            block_keys: Arc::default(),
        }
    }

    proptest! {
        /// Against a reference LRU (a list, most recent last): the same entries evicted in
        /// the same order, whatever mix of hits, misses, inserts and re-inserts; the
        /// invariants hold after every call.
        #[test]
        fn the_cache_evicts_in_lru_order(
            ops in prop::collection::vec((0u8..3, 0u128..24, 1usize..40), 1..400),
            budget in 20usize..200,
        ) {
            let mut c = ChatCache::new(budget);
            // (hash, cost), least recently used first.
            let mut reference: Vec<(u128, usize)> = Vec::new();
            for (op, hash, text) in ops {
                if op == 0 {
                    let found = c.lookup(&[(hash as usize, hash)]).is_some();
                    let at = reference.iter().position(|&(h, _)| h == hash);
                    prop_assert_eq!(found, at.is_some());
                    if let Some(at) = at {
                        let e = reference.remove(at);
                        reference.push(e);
                    }
                } else {
                    let p = entry(hash as usize, text);
                    let cost = p.cost();
                    let mut evicted = Vec::new();
                    c.insert(hash, p, &mut evicted);
                    let mut want = Vec::new();
                    if cost <= budget {
                        if let Some(at) = reference.iter().position(|&(h, _)| h == hash) {
                            want.push(reference.remove(at).0 as usize);
                        }
                        reference.push((hash, cost));
                        while reference.iter().map(|e| e.1).sum::<usize>() > budget {
                            want.push(reference.remove(0).0 as usize);
                        }
                    }
                    let got: Vec<usize> = evicted.iter().map(|p| p.bytes).collect();
                    prop_assert_eq!(got, want);
                }
                c.check().map_err(TestCaseError::fail)?;
                let mut held: Vec<u128> = c.entries.keys().copied().collect();
                let mut want: Vec<u128> = reference.iter().map(|e| e.0).collect();
                held.sort_unstable();
                want.sort_unstable();
                prop_assert_eq!(held, want);
            }
        }
    }

    fn content() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            Just("},{\"role\":\"user\"}]".to_string()),
            Just("<tool_response>r</tool_response>".to_string()),
            Just("a \"q\" \\ é 日本\n".to_string()),
            Just("\n\nlead".to_string()),
            "[a-z ,.{}\\[\\]\n]{0,16}",
        ]
    }

    fn message() -> impl Strategy<Value = Value> {
        (
            prop_oneof![
                6 => Just("system"),
                10 => Just("user"),
                10 => Just("assistant"),
                1 => Just("tool"),
            ],
            content(),
            0..8u8,
        )
            .prop_map(|(role, c, shape)| match shape {
                0 => json!({"content": c, "role": role}),
                1 => json!({"role": role, "content": [{"type": "text", "text": c}]}),
                _ => json!({"role": role, "content": c}),
            })
    }

    /// One turn's edit of the previous messages.
    #[derive(Debug, Clone)]
    enum Edit {
        Append(Vec<Value>),
        Same,
        DropLast,
        ReplaceLast(Value),
    }

    fn edit() -> impl Strategy<Value = Edit> {
        prop_oneof![
            6 => prop::collection::vec(message(), 1..3).prop_map(Edit::Append),
            1 => Just(Edit::Same),
            1 => Just(Edit::DropLast),
            1 => message().prop_map(Edit::ReplaceLast),
        ]
    }

    /// A body for `messages` in one of several shapes clients send.
    fn body(messages: &[Value], shape: u8) -> Vec<u8> {
        let msgs = Value::Array(messages.to_vec());
        let v = match shape % 4 {
            0 => json!({"model": "m", "messages": msgs, "stream": true}),
            1 => json!({"messages": msgs, "model": "m", "cache_salt": "s", "max_tokens": 9}),
            2 => json!({"messages": msgs, "chat_template_kwargs": {"enable_thinking": false}}),
            _ => json!({"model": "m", "add_generation_prompt": false, "messages": msgs}),
        };
        if shape >= 4 {
            serde_json::to_vec_pretty(&v).unwrap()
        } else {
            serde_json::to_vec(&v).unwrap()
        }
    }

    /// The scanner fed `body` read by read (`reads`: the read sizes, cycled; 0 stands for 1).
    fn scanned(body: &[u8], reads: &[usize]) -> Vec<(usize, u128)> {
        let mut sc = PrefixScanner::new();
        let mut at = 0;
        for &n in reads.iter().cycle() {
            if at >= body.len() {
                break;
            }
            at = (at + n.max(1)).min(body.len());
            sc.feed(&body[..at]);
        }
        sc.finish(body)
    }

    #[test]
    fn the_scanner_waits_for_the_byte_after_a_brace() {
        let body = br#"{"messages":[{"role":"user","content":"a}b"} , {"role":"user","content":"c"}],"model":"m"}"#;
        let want = candidates(body);
        // Two message ends (`a}b` is followed by `b`, the last `}` by nothing).
        let first = body.windows(3).position(|w| w == b"\"} ").unwrap() + 2;
        let second = body.windows(3).position(|w| w == b"\"}]").unwrap() + 2;
        assert_eq!(
            want.iter().map(|c| c.0).collect::<Vec<_>>(),
            vec![first, second]
        );
        assert_eq!(want[0].1, prefix_hash(&body[..first]));
        // A read ending right after the first message's `}`, then one ending in the spaces
        // before its `,`: the end is known only once the `,` is there.
        let mut sc = PrefixScanner::new();
        sc.feed(&body[..first]);
        sc.feed(&body[..first + 1]);
        assert!(sc.ends.is_empty());
        sc.feed(&body[..first + 2]);
        assert_eq!(sc.ends.iter().copied().collect::<Vec<_>>(), want[..1]);
        assert_eq!(sc.finish(body), want);
        for n in 1..body.len() {
            assert_eq!(scanned(body, &[n]), want, "reads of {n}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
        /// Whatever the reads, the scanner's answer is `candidates`': on chat bodies and on
        /// bytes dense in braces, commas, brackets and whitespace (more than `MAX_PROBES`
        /// ends, so the window slides).
        #[test]
        fn the_scanner_equals_candidates(
            msgs in prop::collection::vec(message(), 1..6),
            shape in 0..8u8,
            noise in prop::collection::vec(prop::sample::select(b"}},] \n\ta\"".to_vec()), 0..600),
            reads in prop::collection::vec(0..300usize, 1..8),
        ) {
            let chat = body(&msgs, shape);
            prop_assert_eq!(scanned(&chat, &reads), candidates(&chat));
            prop_assert_eq!(scanned(&noise, &reads), candidates(&noise));
        }

        /// Over conversations that grow, repeat, drop and edit turns, in several body shapes:
        /// the key and ids are the full path's, whatever the cache held.
        #[test]
        fn equals_the_full_path(
            start in prop::collection::vec(message(), 1..4),
            edits in prop::collection::vec(edit(), 1..6),
            shape in 0..8u8,
        ) {
            static SHARDS: OnceLock<Mutex<(ShardTokenizers, ShardTokenizers)>> = OnceLock::new();
            let mut g = SHARDS.get_or_init(|| Mutex::new((shard(0), shard(0)))).lock().unwrap_or_else(|p| p.into_inner());
            let (s, r) = &mut *g;
            s.chat = ChatCache::shared(1 << 16);
            // Two routers at different block sizes read the keys' memos in turn: each turn's
            // block keys must be the whole computation's, whichever of them filled the memo.
            let routers = [4, 16].map(|block_size| {
                crate::policy::Router::new(&crate::config::Config { block_size, ..Default::default() })
            });
            let mut msgs = start;
            for (turn, e) in std::iter::once(Edit::Same).chain(std::iter::once(Edit::Same)).chain(edits).enumerate() {
                match e {
                    Edit::Append(m) => msgs.extend(m),
                    Edit::Same => {}
                    Edit::DropLast if msgs.len() > 1 => { msgs.pop(); }
                    Edit::DropLast => {}
                    Edit::ReplaceLast(m) => *msgs.last_mut().unwrap() = m,
                }
                let b = body(&msgs, shape);
                let (key, a) = routed(s, &b).unwrap();
                let (want, failed) = reference(r, &b).unwrap();
                prop_assert_eq!(a.failed, failed);
                for router in routers.iter().cycle().skip(turn % 2).take(2) {
                    let facts = router.request(&key);
                    let want_keys = key.input_ids.as_deref().map_or(Vec::new(), |ids| {
                        kvroute_index::keys::block_keys_in(key.namespace, ids, facts.block_size)
                    });
                    prop_assert_eq!(&*facts.block_keys, &want_keys[..]);
                }
                prop_assert_eq!(key, want);
                // The same body again: a hit when in scope, unless its last message is an
                // assistant's after the query (never cached as a last message).
                let plain = msgs.iter().all(|m| m["content"].is_string() && m["role"] != "tool");
                let n = msgs.len();
                let last_query = msgs.iter().rposition(|m| m["role"] == "user" && !m["content"].as_str().unwrap_or("").starts_with("<tool_response>"));
                let wrappable = msgs[n - 1]["role"] == "assistant" && last_query.is_some_and(|q| q < n - 1);
                if turn == 1 && plain && !wrappable {
                    prop_assert_eq!(stats(s).0, 1);
                }
            }
            lock(&s.chat).check().unwrap();
        }
    }
}
