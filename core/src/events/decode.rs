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
    /// LoRA adapter name (field 7, vLLM PR #27577).
    pub lora_name: Option<String>,
}

/// `BlockRemoved`: blocks were evicted from one tier.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// Engine hashes of the evicted blocks (field 1).
    pub block_hashes: Vec<EngineHash>,
    /// Storage tier (field 2); `None` means GPU.
    pub medium: Option<String>,
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
            Ok(Some(KvEvent::Stored(BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium: string(fields.get(6, "medium")),
                lora_name: string(fields.get(7, "lora_name")),
            })))
        }
        "BlockRemoved" => {
            let block_hashes = hashes(fields.get(1, "block_hashes")).ok_or({
                DecodeError::BadField {
                    index,
                    tag: "BlockRemoved",
                    field: "block_hashes",
                }
            })?;
            Ok(Some(KvEvent::Removed(BlockRemoved {
                block_hashes,
                medium: string(fields.get(2, "medium")),
            })))
        }
        "AllBlocksCleared" => Ok(Some(KvEvent::AllCleared)),
        _ => Ok(None),
    }
}

fn string(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_owned)
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
mod tests;
