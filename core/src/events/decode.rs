//! Decoder of vLLM / SGLang KV-event messages: ZMQ frames → [`EventBatch`].
//!
//! Accepts every shape of `kv-events.md` §3: batch as array `[ts, events, dp_rank]` or map
//! `{"ts", "events", "data_parallel_rank"}`; events as legacy tagged arrays
//! `["BlockStored", …]` or `type`-tagged maps, mixed in one batch; missing trailing fields
//! absent, extra trailing fields and unknown map keys ignored; unknown tags skip the event,
//! never the batch. Hashes of any msgpack int width, negative, or `bin` normalise to `u64`
//! (§3.5). Anything else is a [`DecodeError`]: the caller drops the batch and counts it; no
//! input panics (proptest in this module).

use rmpv::Value;

/// Engine hash of one block, normalised to `u64` (§3.5): non-negative ints as is, negative
/// ints reinterpreted as two's complement, `bin` digests by their last 8 bytes big-endian.
pub type EngineHash = u64;

/// One decoded message: all events one engine step produced (`kv-events.md` §3.1).
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Publisher timestamp, seconds since the Unix epoch. Informational only (§8.14).
    pub ts: f64,
    /// Known events in order.
    pub events: Vec<KvEvent>,
    /// `data_parallel_rank` (vLLM) / `attn_dp_rank` (SGLang); `None` when nil or absent.
    pub dp_rank: Option<u32>,
    /// Events skipped because their tag is unknown (counted, not an error: §3.2).
    pub skipped_events: u32,
}

/// One KV-cache event (`kv-events.md` §3.3–§3.4).
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks entered the cache.
    Stored(BlockStored),
    /// Blocks left the cache.
    Removed(BlockRemoved),
    /// Every block of this publisher was dropped (`AllBlocksCleared`).
    AllCleared,
}

/// `BlockStored`: consecutive full blocks of one sequence entered the cache.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// Engine hashes of the new blocks, in sequence order (field 1).
    pub block_hashes: Vec<EngineHash>,
    /// Engine hash of the block before `block_hashes[0]`; `None` (nil) at sequence start
    /// (field 2).
    pub parent_block_hash: Option<EngineHash>,
    /// Tokens of all blocks, concatenated (field 3); empty for offload stores (§8.8).
    pub token_ids: Vec<u32>,
    /// Declared tokens per block (field 4); 0 when absent or nil.
    pub block_size: usize,
    /// Storage tier (field 6); `None` means GPU (§3.6).
    pub medium: Option<String>,
    /// LoRA adapter name (field 7, vLLM PR #27577); `None` when nil, absent or empty.
    pub lora_name: Option<String>,
    /// Cache salt of the sequence this store starts (`None` when nil, absent or empty), from
    /// the first that says one: the map form's top-level `cache_salt` (Dynamo's reading of
    /// SGLang's map events), `metadata.cache_salt` (SGLang `BlockStoredWithMetadata`: a map in
    /// the array form's field 7 or the map form's `metadata`), else the string of
    /// `extra_keys[0]` (vLLM: block 0's extra keys are `(lora name?, (mm id, offset)…, salt?,
    /// prompt-embeds digest?)`, the salt only when the block is the sequence's first,
    /// `kv_cache_utils.generate_block_hash_extra_keys`): the one string left once a leading
    /// copy of `lora_name` is skipped (multimodal keys are arrays, digests `bin`).
    pub cache_salt: Option<String>,
    /// KV-cache group of the blocks (field 9, vLLM PR #37688); `None` when nil or absent.
    pub group_idx: Option<u32>,
    /// Attention spec of that group (field 10, vLLM PR #40984), e.g. `"full_attention"`,
    /// `"sliding_window"`, `"mamba"`; `None` when nil or absent.
    pub kv_cache_spec_kind: Option<String>,
    /// Sliding window of that group, tokens (field 11, PR #40984); informational.
    pub kv_cache_spec_sliding_window: Option<u32>,
}

/// `BlockRemoved`: blocks were evicted from one tier.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// Engine hashes of the evicted blocks (field 1).
    pub block_hashes: Vec<EngineHash>,
    /// Storage tier (field 2); `None` means GPU.
    pub medium: Option<String>,
    /// KV-cache group of the blocks (field 3, vLLM PR #37688); `None` when nil or absent.
    pub group_idx: Option<u32>,
    /// Attention spec of that group when the removal names it (field 4 or by name; vLLM's own
    /// `BlockRemoved` carries only `group_idx`, Dynamo's wire reader accepts the kind too).
    pub kv_cache_spec_kind: Option<String>,
}

/// Why a message or batch was refused. The stream goes on; the caller counts it per worker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The payload is not one complete msgpack value (truncated or invalid bytes).
    #[error("payload is not valid msgpack")]
    Msgpack,
    /// Bytes follow the batch value.
    #[error("{extra} bytes after the msgpack batch")]
    TrailingBytes {
        /// Extra bytes.
        extra: usize,
    },
    /// The batch is not an array `[ts, events, rank]` nor a map with `events`.
    #[error("batch is not an array or map with an event list")]
    NotABatch,
    /// A field of a known event has the wrong type.
    #[error("event {index} ({tag}): field {field} has the wrong type")]
    BadField {
        /// Position of the event in the batch.
        index: usize,
        /// Event tag (`"BlockStored"`, …).
        tag: &'static str,
        /// Field name as in vLLM (`"block_hashes"`, …).
        field: &'static str,
    },
    /// A cache-partition or cache-group field of a known event (`lora_name`, `extra_keys`,
    /// `cache_salt`, `metadata`, `group_idx`, `kv_cache_spec_kind`,
    /// `kv_cache_spec_sliding_window`) has the wrong type, or `extra_keys[0]` names more than
    /// one salt: the event's partition is unknown, so the batch is dropped (counted as a
    /// decode error and in `StreamStats::bad_partitions`) rather than indexed in a wrong one.
    #[error("event {index} ({tag}): partition field {field} is malformed")]
    BadPartition {
        /// Position of the event in the batch.
        index: usize,
        /// Event tag.
        tag: &'static str,
        /// Field name as in vLLM / SGLang.
        field: &'static str,
    },
    /// A live message does not have exactly 3 frames (`kv-events.md` §1).
    #[error("message has {frames} frames, expected 3 [topic, seq, payload]")]
    FrameCount {
        /// Frames received.
        frames: usize,
    },
    /// The seq frame is not 8 bytes.
    #[error("seq frame has {len} bytes, expected 8")]
    SeqLength {
        /// Bytes in the frame.
        len: usize,
    },
}

/// Decodes one msgpack `EventBatch` payload (`kv-events.md` §3).
///
/// # Errors
/// - [`DecodeError::Msgpack`]: not one complete msgpack value (also for nesting deeper than
///   rmpv's limit).
/// - [`DecodeError::TrailingBytes`]: bytes after the value.
/// - [`DecodeError::NotABatch`]: neither `[ts, events, …]` nor `{"events": […], …}`.
/// - [`DecodeError::BadField`]: a known event whose hashes, token ids, parent or sizes have the
///   wrong type (a malformed batch is dropped whole, never applied in part).
/// - [`DecodeError::BadPartition`]: a known event whose partition or group fields are
///   malformed (see the variant).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut rd = payload;
    let value = rmpv::decode::read_value(&mut rd).map_err(|_| DecodeError::Msgpack)?;
    if !rd.is_empty() {
        return Err(DecodeError::TrailingBytes { extra: rd.len() });
    }
    let (ts, events, rank) = match &value {
        Value::Array(a) => (a.first(), a.get(1), a.get(2)),
        Value::Map(m) => (
            map_get(m, "ts"),
            map_get(m, "events"),
            map_get(m, "data_parallel_rank").or_else(|| map_get(m, "attn_dp_rank")),
        ),
        _ => return Err(DecodeError::NotABatch),
    };
    let Some(Value::Array(raw_events)) = events else {
        return Err(DecodeError::NotABatch);
    };
    let ts = match ts {
        Some(Value::F64(f)) => *f,
        Some(Value::F32(f)) => f64::from(*f),
        Some(v) => v.as_i64().map_or(0.0, |i| i as f64),
        None => 0.0,
    };
    let dp_rank = rank
        .and_then(Value::as_u64)
        .and_then(|r| u32::try_from(r).ok());
    let mut batch = EventBatch {
        ts,
        events: Vec::with_capacity(raw_events.len()),
        dp_rank,
        skipped_events: 0,
    };
    for (index, ev) in raw_events.iter().enumerate() {
        match decode_event(index, ev)? {
            Some(e) => batch.events.push(e),
            None => batch.skipped_events += 1,
        }
    }
    Ok(batch)
}

/// Field access for one event, by position (array form, position after the tag) or by name
/// (map form).
enum Fields<'a> {
    Array(&'a [Value]),
    Map(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    /// Field `name` at array position `pos` (1-based, after the tag). Nil counts as absent.
    fn get(&self, pos: usize, name: &str) -> Option<&'a Value> {
        let v = match self {
            Fields::Array(a) => a.get(pos),
            Fields::Map(m) => map_get(m, name),
        };
        v.filter(|v| !v.is_nil())
    }
}

fn map_get<'a>(m: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    m.iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// Decodes one event; `Ok(None)` for an unknown tag or a value that is not an event at all.
fn decode_event(index: usize, ev: &Value) -> Result<Option<KvEvent>, DecodeError> {
    let (tag, fields) = match ev {
        Value::Array(a) => match a.first().and_then(Value::as_str) {
            Some(t) => (t, Fields::Array(a)),
            None => return Ok(None),
        },
        Value::Map(m) => match map_get(m, "type").and_then(Value::as_str) {
            Some(t) => (t, Fields::Map(m)),
            None => return Ok(None),
        },
        _ => return Ok(None),
    };
    match tag {
        "BlockStored" => {
            let tag = "BlockStored";
            let bad = |field| DecodeError::BadField { index, tag, field };
            let block_hashes =
                hashes(fields.get(1, "block_hashes")).ok_or_else(|| bad("block_hashes"))?;
            let parent_block_hash = match fields.get(2, "parent_block_hash") {
                None => None,
                Some(v) => Some(hash(v).ok_or_else(|| bad("parent_block_hash"))?),
            };
            let token_ids = match fields.get(3, "token_ids") {
                None => Vec::new(),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| bad("token_ids"))?,
                Some(_) => return Err(bad("token_ids")),
            };
            let block_size = match fields.get(4, "block_size") {
                None => 0,
                Some(v) => v
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| bad("block_size"))?,
            };
            let part = |field| DecodeError::BadPartition { index, tag, field };
            // Field 7: vLLM's `lora_name` string, or SGLang's `metadata` map in the array form.
            let (lora_name, mut cache_salt) = match fields.get(7, "lora_name") {
                None => (None, None),
                Some(Value::String(s)) => (
                    Some(s.as_str().ok_or_else(|| part("lora_name"))?.to_owned()),
                    None,
                ),
                Some(Value::Map(m)) if matches!(fields, Fields::Array(_)) => {
                    (None, metadata_salt(m).map_err(|()| part("metadata"))?)
                }
                Some(_) => return Err(part("lora_name")),
            };
            if let Fields::Map(m) = &fields {
                if let Some(v) = map_get(m, "cache_salt").filter(|v| !v.is_nil()) {
                    cache_salt = Some(text(v).ok_or_else(|| part("cache_salt"))?);
                } else {
                    match map_get(m, "metadata").filter(|v| !v.is_nil()) {
                        None => {}
                        Some(Value::Map(md)) => {
                            cache_salt = metadata_salt(md).map_err(|()| part("metadata"))?;
                        }
                        Some(_) => return Err(part("metadata")),
                    }
                }
            }
            let lora_name = lora_name.filter(|s| !s.is_empty());
            let extra_salt = extra_keys_salt(fields.get(8, "extra_keys"), lora_name.as_deref())
                .map_err(|()| part("extra_keys"))?;
            let cache_salt = cache_salt.or(extra_salt).filter(|s| !s.is_empty());
            Ok(Some(KvEvent::Stored(BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium: string(fields.get(6, "medium")),
                lora_name,
                cache_salt,
                group_idx: small_int(fields.get(9, "group_idx")).map_err(|()| part("group_idx"))?,
                kv_cache_spec_kind: opt_text(fields.get(10, "kv_cache_spec_kind"))
                    .map_err(|()| part("kv_cache_spec_kind"))?,
                kv_cache_spec_sliding_window: small_int(
                    fields.get(11, "kv_cache_spec_sliding_window"),
                )
                .map_err(|()| part("kv_cache_spec_sliding_window"))?,
            })))
        }
        "BlockRemoved" => {
            let tag = "BlockRemoved";
            let block_hashes = hashes(fields.get(1, "block_hashes")).ok_or({
                DecodeError::BadField {
                    index,
                    tag,
                    field: "block_hashes",
                }
            })?;
            let part = |field| DecodeError::BadPartition { index, tag, field };
            Ok(Some(KvEvent::Removed(BlockRemoved {
                block_hashes,
                medium: string(fields.get(2, "medium")),
                group_idx: small_int(fields.get(3, "group_idx")).map_err(|()| part("group_idx"))?,
                kv_cache_spec_kind: opt_text(fields.get(4, "kv_cache_spec_kind"))
                    .map_err(|()| part("kv_cache_spec_kind"))?,
            })))
        }
        "AllBlocksCleared" => Ok(Some(KvEvent::AllCleared)),
        _ => Ok(None),
    }
}

fn string(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_owned)
}

/// A valid UTF-8 msgpack string.
fn text(v: &Value) -> Option<String> {
    v.as_str().map(str::to_owned)
}

/// An optional string field: absent/nil → `None`; a string → it; else malformed.
fn opt_text(v: Option<&Value>) -> Result<Option<String>, ()> {
    v.map(|v| text(v).ok_or(())).transpose()
}

/// An optional non-negative int field that fits `u32`: absent/nil → `None`; else malformed.
fn small_int(v: Option<&Value>) -> Result<Option<u32>, ()> {
    v.map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or(()))
        .transpose()
}

/// `cache_salt` of an SGLang `metadata` map: absent/nil → `None`; not a string → malformed.
fn metadata_salt(m: &[(Value, Value)]) -> Result<Option<String>, ()> {
    opt_text(map_get(m, "cache_salt").filter(|v| !v.is_nil()))
}

/// The cache salt in vLLM's `extra_keys` (list with one entry per block, each a tuple or nil):
/// the string of block 0's tuple once a leading copy of `lora` is skipped; `None` without one.
/// Malformed: `extra_keys` not a list, an entry neither a list nor nil, or two such strings.
fn extra_keys_salt(v: Option<&Value>, lora: Option<&str>) -> Result<Option<String>, ()> {
    let entries = match v {
        None => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(()),
    };
    if entries
        .iter()
        .any(|e| !matches!(e, Value::Array(_) | Value::Nil))
    {
        return Err(());
    }
    let Some(Value::Array(keys)) = entries.first() else {
        return Ok(None);
    };
    let skip = usize::from(lora.is_some() && keys.first().and_then(Value::as_str) == lora);
    let mut salts = keys[skip..].iter().filter(|k| k.is_str());
    let salt = salts.next().map(|k| text(k).ok_or(())).transpose()?;
    if salts.next().is_some() {
        return Err(());
    }
    Ok(salt)
}

fn hashes(v: Option<&Value>) -> Option<Vec<EngineHash>> {
    match v {
        Some(Value::Array(a)) => a.iter().map(hash).collect(),
        // An absent list is an empty store/removal (nothing to apply), not an error.
        None => Some(Vec::new()),
        Some(_) => None,
    }
}

/// Normalises one wire hash to `u64` (`kv-events.md` §3.5). `None` for a non-hash value.
pub fn hash(v: &Value) -> Option<EngineHash> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|n| n as u64)),
        Value::Binary(b) => {
            // Last 8 bytes big-endian; shorter digests are left-padded with zeros.
            let tail = &b[b.len().saturating_sub(8)..];
            Some(tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
        }
        _ => None,
    }
}

/// A live message split into its parts (`kv-events.md` §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveFrames<'a> {
    /// Topic frame (often empty).
    pub topic: &'a [u8],
    /// Batch sequence number (big-endian unsigned on the wire).
    pub seq: u64,
    /// msgpack payload, for [`decode_batch`].
    pub payload: &'a [u8],
}

/// Splits a live SUB message `[topic, seq(8 B BE), payload]`.
///
/// # Errors
/// [`DecodeError::FrameCount`] unless exactly 3 frames; [`DecodeError::SeqLength`] unless
/// the seq frame is 8 bytes.
pub fn split_live<'a>(frames: &'a [Vec<u8>]) -> Result<LiveFrames<'a>, DecodeError> {
    let [topic, seq, payload] = frames else {
        return Err(DecodeError::FrameCount {
            frames: frames.len(),
        });
    };
    Ok(LiveFrames {
        topic,
        seq: seq8(seq)?,
        payload,
    })
}

fn seq8(f: &[u8]) -> Result<u64, DecodeError> {
    let b: [u8; 8] = f
        .try_into()
        .map_err(|_| DecodeError::SeqLength { len: f.len() })?;
    Ok(u64::from_be_bytes(b))
}

/// One replay reply as seen by a DEALER (`kv-events.md` §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayFrames<'a> {
    /// A buffered batch.
    Batch {
        /// Its seq.
        seq: u64,
        /// Its msgpack payload.
        payload: &'a [u8],
    },
    /// The end marker: seq frame all `ff` and an empty payload.
    End,
}

/// Parses one replay reply: after an optional empty delimiter frame, `[seq8, payload]`
/// (vLLM < v0.26, SGLang) or `[topic, seq8, payload]` (vLLM ≥ v0.26, bug B23). The end marker
/// is recognised by its all-`ff` seq frame with an empty payload, whatever precedes it.
///
/// # Errors
/// [`DecodeError::FrameCount`] for fewer than 2 or more than 3 frames after the delimiter;
/// [`DecodeError::SeqLength`] when the seq frame is not 8 bytes.
pub fn split_replay<'a>(frames: &'a [Vec<u8>]) -> Result<ReplayFrames<'a>, DecodeError> {
    let rest = match frames {
        [first, rest @ ..] if first.is_empty() && rest.len() >= 2 => rest,
        _ => frames,
    };
    let (seq, payload) = match rest {
        [seq, payload] | [_, seq, payload] => (seq, payload),
        _ => {
            return Err(DecodeError::FrameCount {
                frames: frames.len(),
            });
        }
    };
    let seq = seq8(seq)?;
    if seq == u64::MAX && payload.is_empty() {
        return Ok(ReplayFrames::End);
    }
    Ok(ReplayFrames::Batch { seq, payload })
}

#[cfg(test)]
pub(crate) mod tests;
