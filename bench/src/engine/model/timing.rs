//! Step-time model: Dynamo mocker's "polynomial" fit, times in ms.
//! Source: `engine-model.md` §4.

/// Modelled prefill time in ms for `new_tokens` uncached prompt tokens in one step:
/// `4.209989e-07·T² + 1.518344e-02·T + 16.50142`. Callers skip it when `T = 0`
/// (a fully cached prompt costs no prefill time).
pub fn prefill_ms(new_tokens: usize) -> f64 {
    let t = new_tokens as f64;
    4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142
}

/// Modelled decode time in ms for one step with KV usage `u` (active KV tokens / capacity,
/// 0–1): `max(1, −25.74·u² + 54.01·u + 5.74)`.
pub fn decode_ms(kv_usage: f64) -> f64 {
    let u = kv_usage;
    (-25.74 * u * u + 54.01 * u + 5.74).max(1.0)
}

/// Turns one step's work into a duration in ms, applying the speedup divisors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingModel {
    /// Divides every modelled time; 0 = no delay at all.
    pub speedup_ratio: f64,
    /// Further divides decode time (speculative decoding); 0 is treated as 1.
    pub decode_speedup_ratio: f64,
}

impl TimingModel {
    /// Step time in ms: `prefill_ms(prefill_tokens)` if `prefill_tokens > 0`, divided by
    /// `speedup_ratio`, plus `decode_ms(kv_usage)` if `decoding`, divided by
    /// `speedup_ratio × decode_speedup_ratio`. 0 when `speedup_ratio` is 0 or the step is empty.
    pub fn step_ms(&self, prefill_tokens: usize, decoding: bool, kv_usage: f64) -> f64 {
        if self.speedup_ratio <= 0.0 {
            return 0.0;
        }
        let mut ms = 0.0;
        if prefill_tokens > 0 {
            ms += prefill_ms(prefill_tokens) / self.speedup_ratio;
        }
        if decoding {
            let d = if self.decode_speedup_ratio > 0.0 {
                self.decode_speedup_ratio
            } else {
                1.0
            };
            ms += decode_ms(kv_usage) / (self.speedup_ratio * d);
        }
        ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round2(x: f64) -> f64 {
        (x * 100.0).round() / 100.0
    }

    #[test]
    fn prefill_table_engine_model_md_section_4() {
        let table = [
            (1, 16.52),
            (512, 24.39),
            (1_024, 32.49),
            (8_192, 169.14),
            (16_384, 378.28),
        ];
        for (t, ms) in table {
            assert_eq!(round2(prefill_ms(t)), ms, "T = {t}");
        }
    }

    #[test]
    fn decode_table_engine_model_md_section_4() {
        let table = [
            (0.0, 5.74),
            (0.25, 17.63),
            (0.5, 26.31),
            (0.75, 31.77),
            (1.0, 34.01),
        ];
        for (u, ms) in table {
            assert_eq!(round2(decode_ms(u)), ms, "u = {u}");
        }
    }

    #[test]
    fn step_combines_terms_and_applies_speedups() {
        let m = TimingModel {
            speedup_ratio: 2.0,
            decode_speedup_ratio: 4.0,
        };
        let want = prefill_ms(512) / 2.0 + decode_ms(0.5) / 8.0;
        assert!((m.step_ms(512, true, 0.5) - want).abs() < 1e-9);
        assert_eq!(m.step_ms(0, false, 0.5), 0.0);
        assert!((m.step_ms(0, true, 0.0) - 5.74 / 8.0).abs() < 1e-9);
        let off = TimingModel {
            speedup_ratio: 0.0,
            decode_speedup_ratio: 1.0,
        };
        assert_eq!(off.step_ms(8_192, true, 1.0), 0.0);
    }
}
