//! Deterministic filler output tokens (`engine-model.md` §6: "output tokens are deterministic
//! filler from a seeded generator").

/// Vocabulary of output tokens: `(Qwen3 id, word)` where the id's token string is `Ġ` + word,
/// i.e. the word with a leading space. These are the first 256 `WORD_IDS` of `traces.md` §3
/// (tokens `Ġ[a-z]{3,8}`, sorted by id), so the text `" w1 w2 …"` re-tokenizes to exactly these
/// ids. Generated from `../data/tokenizers/qwen3/tokenizer.json` with
/// `python3 -c "import json,re; v=json.load(open('tokenizer.json'))['model']['vocab'];
/// print(sorted(i for t,i in v.items() if re.fullmatch('Ġ[a-z]{3,8}',t))[:256])"`.
pub const OUTPUT_VOCAB: [(u32, &str); 256] = [
    (279, "the"),
    (323, "and"),
    (369, "for"),
    (390, "con"),
    (419, "this"),
    (429, "that"),
    (448, "with"),
    (462, "pro"),
    (469, "com"),
    (470, "return"),
    (498, "you"),
    (501, "new"),
    (504, "from"),
    (525, "are"),
    (526, "int"),
    (536, "class"),
    (537, "not"),
    (572, "was"),
    (584, "public"),
    (592, "res"),
    (607, "str"),
    (614, "have"),
    (633, "get"),
    (646, "can"),
    (656, "self"),
    (678, "all"),
    (683, "cont"),
    (686, "will"),
    (697, "your"),
    (700, "out"),
    (702, "has"),
    (707, "def"),
    (714, "but"),
    (729, "function"),
    (733, "const"),
    (737, "void"),
    (738, "set"),
    (762, "var"),
    (770, "else"),
    (803, "more"),
    (806, "his"),
    (807, "they"),
    (817, "per"),
    (821, "data"),
    (825, "one"),
    (827, "dis"),
    (829, "name"),
    (830, "true"),
    (835, "end"),
    (845, "null"),
    (855, "pre"),
    (862, "their"),
    (869, "private"),
    (879, "who"),
    (882, "time"),
    (883, "man"),
    (892, "which"),
    (894, "any"),
    (895, "false"),
    (897, "value"),
    (906, "app"),
    (911, "about"),
    (912, "add"),
    (914, "string"),
    (916, "over"),
    (939, "des"),
    (943, "type"),
    (946, "inter"),
    (949, "part"),
    (975, "work"),
    (979, "when"),
    (990, "use"),
    (1007, "off"),
    (1008, "other"),
    (1012, "been"),
    (1026, "sup"),
    (1029, "acc"),
    (1030, "had"),
    (1033, "were"),
    (1034, "file"),
    (1035, "would"),
    (1039, "our"),
    (1042, "year"),
    (1044, "val"),
    (1045, "some"),
    (1052, "there"),
    (1053, "said"),
    (1059, "her"),
    (1063, "comm"),
    (1071, "ass"),
    (1075, "like"),
    (1077, "let"),
    (1083, "also"),
    (1091, "than"),
    (1099, "static"),
    (1101, "just"),
    (1102, "result"),
    (1105, "them"),
    (1119, "into"),
    (1128, "what"),
    (1133, "pos"),
    (1140, "list"),
    (1142, "case"),
    (1156, "first"),
    (1159, "import"),
    (1160, "act"),
    (1161, "char"),
    (1172, "only"),
    (1173, "print"),
    (1181, "its"),
    (1182, "back"),
    (1184, "need"),
    (1186, "sub"),
    (1191, "start"),
    (1196, "user"),
    (1197, "ent"),
    (1212, "under"),
    (1217, "reg"),
    (1221, "then"),
    (1231, "may"),
    (1240, "org"),
    (1246, "how"),
    (1251, "people"),
    (1257, "ind"),
    (1258, "jav"),
    (1265, "should"),
    (1273, "test"),
    (1274, "bet"),
    (1281, "make"),
    (1283, "after"),
    (1290, "right"),
    (1293, "long"),
    (1299, "rem"),
    (1303, "ext"),
    (1308, "min"),
    (1329, "loc"),
    (1334, "array"),
    (1340, "she"),
    (1343, "exp"),
    (1346, "par"),
    (1349, "read"),
    (1351, "rel"),
    (1352, "form"),
    (1356, "trans"),
    (1366, "want"),
    (1367, "comp"),
    (1372, "number"),
    (1373, "require"),
    (1375, "col"),
    (1376, "key"),
    (1378, "two"),
    (1379, "size"),
    (1380, "where"),
    (1392, "arg"),
    (1393, "while"),
    (1395, "rec"),
    (1396, "dif"),
    (1398, "spec"),
    (1401, "look"),
    (1410, "could"),
    (1414, "know"),
    (1420, "ser"),
    (1424, "hand"),
    (1429, "most"),
    (1430, "try"),
    (1431, "now"),
    (1435, "him"),
    (1438, "break"),
    (1449, "every"),
    (1459, "point"),
    (1460, "std"),
    (1461, "fil"),
    (1463, "mod"),
    (1465, "error"),
    (1467, "text"),
    (1471, "pol"),
    (1473, "show"),
    (1477, "find"),
    (1482, "current"),
    (1483, "used"),
    (1486, "play"),
    (1487, "log"),
    (1490, "see"),
    (1492, "help"),
    (1493, "these"),
    (1494, "pass"),
    (1495, "down"),
    (1496, "even"),
    (1509, "item"),
    (1513, "don"),
    (1521, "did"),
    (1526, "through"),
    (1529, "inv"),
    (1537, "last"),
    (1538, "event"),
    (1549, "again"),
    (1550, "high"),
    (1555, "line"),
    (1558, "does"),
    (1562, "tem"),
    (1573, "before"),
    (1576, "because"),
    (1582, "dist"),
    (1584, "state"),
    (1585, "cons"),
    (1588, "here"),
    (1590, "final"),
    (1594, "del"),
    (1598, "run"),
    (1602, "very"),
    (1614, "model"),
    (1615, "mon"),
    (1616, "way"),
    (1618, "call"),
    (1619, "att"),
    (1620, "cal"),
    (1622, "dec"),
    (1629, "num"),
    (1632, "well"),
    (1633, "object"),
    (1635, "years"),
    (1638, "default"),
    (1640, "ins"),
    (1642, "java"),
    (1643, "sim"),
    (1651, "view"),
    (1652, "pres"),
    (1656, "bel"),
    (1657, "many"),
    (1660, "being"),
    (1661, "good"),
    (1667, "using"),
    (1673, "stud"),
    (1681, "request"),
    (1682, "child"),
    (1685, "param"),
    (1687, "echo"),
    (1697, "person"),
    (1707, "style"),
    (1709, "que"),
    (1714, "method"),
    (1720, "expect"),
    (1724, "prot"),
    (1729, "sur"),
    (1730, "found"),
    (1736, "post"),
    (1741, "such"),
    (1744, "think"),
    (1745, "differ"),
    (1753, "much"),
    (1757, "som"),
    (1758, "http"),
    (1760, "count"),
    (1761, "inst"),
    (1766, "gener"),
    (1774, "med"),
];

/// SplitMix64 step: advances `state` by the golden gamma and returns the mixed output.
/// Source: Steele, Lea, Flood 2014 (the same generator as `traces.md` §3).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Index into [`OUTPUT_VOCAB`] of the output token at generation position `position` of the
/// output stream `stream` under engine seed `seed`: SplitMix64 seeded with `seed`, re-keyed by
/// `stream` then `position`. Depends on nothing else, so preemption, batching and timing never
/// change a request's output. [`super::EngineCore::add_request`] uses the request id as the
/// stream; the HTTP server uses [`OutputStream`]s derived from the request.
pub fn output_word(seed: u64, stream: u64, position: u32) -> usize {
    let mut s = seed;
    let a = splitmix64(&mut s);
    let mut s = a ^ stream;
    let b = splitmix64(&mut s);
    let mut s = b ^ u64::from(position);
    (splitmix64(&mut s) % OUTPUT_VOCAB.len() as u64) as usize
}

/// Token id at position `position` of output stream `stream` (see [`output_word`]).
pub fn output_token(seed: u64, stream: u64, position: u32) -> u32 {
    OUTPUT_VOCAB[output_word(seed, stream, position)].0
}

/// Text at position `position` of output stream `stream`: its word with a leading space, e.g.
/// `" the"`; equals the tokenizer's decoding of [`output_token`].
pub fn output_text(seed: u64, stream: u64, position: u32) -> &'static str {
    // Every entry is ASCII, so slicing the static word list is safe; build " word" once.
    static SPACED: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let spaced = SPACED.get_or_init(|| OUTPUT_VOCAB.iter().map(|(_, w)| format!(" {w}")).collect());
    &spaced[output_word(seed, stream, position)]
}

/// True when `id` is one of the [`OUTPUT_VOCAB`] ids.
pub fn is_output_token(id: u32) -> bool {
    OUTPUT_VOCAB.binary_search_by_key(&id, |(i, _)| *i).is_ok()
}

/// Where a request's output comes from: output token `j` of the request is
/// [`output_token`]`(seed, key, start + j)`.
///
/// **Continuation rule.** The key never depends on text the engine generated, and `start`
/// counts the generated tokens a continuation request carries, so a request cut after K tokens
/// and re-sent with those K tokens appended (to the prompt, or as the final assistant message
/// with `continue_final_message`) to any engine with the same seed continues the same
/// sequence: the concatenated texts equal one unbroken run's. See [`prompt_stream`] (prompt
/// ids: completions, `/generate`) and [`keyed_stream`] (chat).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputStream {
    /// Generator key (second argument of [`output_token`]).
    pub key: u64,
    /// Generation position of the request's first output token.
    pub start: u32,
}

/// Chains `x` into the key `h` (one SplitMix64 step of `h ^ x`).
fn mix(h: u64, x: u64) -> u64 {
    let mut s = h ^ x;
    splitmix64(&mut s)
}

/// Key of a stream before any prompt token: mixes the request's optional `seed` field, so the
/// same prompt with another seed gives another output. `None` and `Some(_)` never collide.
fn salt_key(request_seed: Option<u64>) -> u64 {
    match request_seed {
        None => mix(0, 0x6B76_726F_7574_6500), // "kvroute\0"
        Some(s) => mix(mix(1, 0x6B76_726F_7574_6501), s),
    }
}

/// The output stream of a request whose prompt is `ids` (completions with text or ids,
/// `/generate`), for engine seed `seed` and the request's `seed` field `request_seed`.
///
/// Rule: for a root length r, let `key(r)` chain the salt (from `request_seed`) and
/// `ids[..r]`. The request continues at `start = K`, the largest k < `ids.len()` such that the
/// last k ids are exactly positions `0..k` of the stream `key(n − k)` (n = `ids.len()`), with
/// `key = key(n − K)`; K = 0 (the whole prompt is the root) when no tail matches. A prompt
/// that is another request's prompt plus the K tokens that request produced therefore gets
/// that request's key and `start = K` (the request's own K was maximal, so no longer tail can
/// match). Cost: O(n) hashing plus, for each candidate in the trailing run of
/// [`OUTPUT_VOCAB`] ids, a check that almost always fails at its first token.
pub fn prompt_stream(seed: u64, request_seed: Option<u64>, ids: &[u32]) -> OutputStream {
    let n = ids.len();
    let tail = ids
        .iter()
        .rev()
        .take_while(|&&t| is_output_token(t))
        .count()
        .min(n.saturating_sub(1));
    let mut h = salt_key(request_seed);
    for &t in &ids[..n - tail] {
        h = mix(h, u64::from(t));
    }
    // keys[j] = key(n − tail + j).
    let mut keys = Vec::with_capacity(tail + 1);
    keys.push(h);
    for &t in &ids[n - tail..] {
        h = mix(h, u64::from(t));
        keys.push(h);
    }
    for k in (1..=tail).rev() {
        let key = keys[tail - k];
        let generated = &ids[n - k..];
        if generated
            .iter()
            .zip(0u32..)
            .all(|(&t, i)| output_token(seed, key, i) == t)
        {
            return OutputStream {
                key,
                start: k as u32,
            };
        }
    }
    OutputStream {
        key: keys[tail],
        start: 0,
    }
}

/// The output stream of a request identified by `identity` (bytes that do not contain
/// generated text, e.g. a chat's messages without the continued final message) that already
/// carries `start` generated tokens; `request_seed` as in [`prompt_stream`].
pub fn keyed_stream(request_seed: Option<u64>, identity: &[u8], start: u32) -> OutputStream {
    OutputStream {
        key: mix(salt_key(request_seed), xxhash_rust::xxh3::xxh3_64(identity)),
        start,
    }
}

/// Text of all output tokens with ids `token_ids` (each from [`OUTPUT_VOCAB`]); unknown ids
/// decode to `""`.
pub fn decode_output(token_ids: &[u32]) -> String {
    let mut s = String::new();
    for t in token_ids {
        if let Ok(i) = OUTPUT_VOCAB.binary_search_by_key(t, |(id, _)| *id) {
            s.push(' ');
            s.push_str(OUTPUT_VOCAB[i].1);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_traces_md_vector() {
        // traces.md §3 generator with state (ns << 32) | id = (0, 0): first token 73221 is a
        // WORD_IDS entry; here we only check the raw generator is the standard one:
        // SplitMix64 from 0 yields 0xE220A8397B1DCDAF first.
        let mut s = 0u64;
        assert_eq!(splitmix64(&mut s), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn vocab_sorted_and_deterministic() {
        assert!(OUTPUT_VOCAB.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(OUTPUT_VOCAB[0], (279, "the"));
        let a: Vec<u32> = (0..50).map(|i| output_token(7, 3, i)).collect();
        let b: Vec<u32> = (0..50).map(|i| output_token(7, 3, i)).collect();
        assert_eq!(a, b);
        assert_ne!(
            a,
            (0..50).map(|i| output_token(8, 3, i)).collect::<Vec<_>>()
        );
        assert_ne!(
            a,
            (0..50).map(|i| output_token(7, 4, i)).collect::<Vec<_>>()
        );
        let text: String = (0..50).map(|i| output_text(7, 3, i)).collect();
        assert_eq!(decode_output(&a), text);
    }

    /// A prompt that is another prompt plus the first K tokens of its output continues at K
    /// with the same key; a prompt with an unrelated vocabulary tail does not.
    #[test]
    fn prompt_stream_finds_the_generated_tail() {
        let prompt: Vec<u32> = (5000..5100).collect();
        for request_seed in [None, Some(9)] {
            let s0 = prompt_stream(7, request_seed, &prompt);
            assert_eq!(s0.start, 0);
            let out: Vec<u32> = (0..40).map(|i| output_token(7, s0.key, i)).collect();
            for k in [1usize, 15, 39] {
                let mut cont = prompt.clone();
                cont.extend_from_slice(&out[..k]);
                let s = prompt_stream(7, request_seed, &cont);
                assert_eq!((s.key, s.start), (s0.key, k as u32), "k={k}");
            }
            // Another engine seed does not recognise the tail.
            let mut cont = prompt.clone();
            cont.extend_from_slice(&out[..15]);
            assert_eq!(prompt_stream(8, request_seed, &cont).start, 0);
        }
        assert_ne!(
            prompt_stream(7, None, &prompt).key,
            prompt_stream(7, Some(0), &prompt).key
        );
        // The prompt's tail is vocabulary words, but not this stream's: start stays 0.
        let mut words = prompt.clone();
        words.extend(OUTPUT_VOCAB[..20].iter().map(|(id, _)| *id));
        assert_eq!(prompt_stream(7, None, &words).start, 0);
        // A prompt made only of one generated token is its own root (k < n).
        assert_eq!(prompt_stream(7, None, &[279]).start, 0);
        assert_eq!(prompt_stream(7, None, &[]).start, 0);
    }
}
