//! The load side of routing:
//! - [`engine_report`]: an engine's own load report, read from its `/metrics`;
//! - [`active`]: what this router booked on each worker (prefill tokens and time, active
//!   blocks, since-poll credit), the per-request lifecycle of anchors.md §3.3;
//! - [`timing`]: each worker's prefill curve, learned online.
//!
//! (The per-request load token, `LoadGuard`, lives with the registry in [`crate::workers`].)

pub mod active;
pub mod timing;

/// What an engine said about its load at its last poll (engine-model.md §7).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineReport {
    /// Requests running.
    pub running: usize,
    /// Requests queued.
    pub waiting: usize,
    /// New (uncached) prompt tokens queued, when the engine says (SGLang's
    /// `num_waiting_uncached_tokens`; vLLM has none): SMG's queued tokens.
    pub waiting_tokens: Option<u64>,
    /// Used fraction of KV memory, 0–1 (`vllm:kv_cache_usage_perc`, SGLang `token_usage`);
    /// `None` when the engine did not say (pressure unknown, not 0).
    pub kv_usage: Option<f64>,
    /// KV memory, blocks (vLLM's `num_gpu_blocks` label of `vllm:cache_config_info`); `None`
    /// when not said.
    pub capacity_blocks: Option<u64>,
}

impl EngineReport {
    /// A report of `requests` running + waiting and nothing else (the simulator's and older
    /// callers' form): all counted as running.
    pub fn requests(requests: usize) -> Self {
        Self {
            running: requests,
            ..Self::default()
        }
    }

    /// Running + waiting.
    pub fn total(&self) -> usize {
        self.running + self.waiting
    }
}

/// Running and waiting request gauges, by engine: vLLM (`vllm:num_requests_running`,
/// `vllm:num_requests_waiting`), SGLang up to v0.5.3 (`sglang:` prefix) and from v0.5.4
/// (`sglang_`). Source: engine-model.md §7.
/// Listed in pairs: running, then waiting.
const REQUEST_GAUGES: [&str; 6] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang_num_running_reqs",
    "sglang_num_queue_reqs",
];

/// KV usage gauges (0–1): vLLM V1, vLLM V0, SGLang under both prefixes (engine-model.md §7).
const KV_USAGE_GAUGES: [&str; 4] = [
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
    "sglang_token_usage",
];

/// An engine's load report from its Prometheus text `metrics`: running and waiting requests
/// as [`engine_requests`] sums them (gauges in even places of `REQUEST_GAUGES` are running,
/// odd ones waiting), and the KV usage: the largest sample of a known usage gauge (the
/// fullest DP rank is the one that evicts first), clamped to 0–1. `None` when no request
/// gauge appears.
pub fn engine_report(metrics: &str) -> Option<EngineReport> {
    let mut seen = false;
    let mut r = EngineReport::default();
    let (mut running, mut waiting) = (0.0f64, 0.0f64);
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        let Some(v) = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
        else {
            continue;
        };
        if let Some(i) = REQUEST_GAUGES.iter().position(|g| *g == name) {
            seen = true;
            if i % 2 == 0 {
                running += v;
            } else {
                waiting += v;
            }
        } else if KV_USAGE_GAUGES.contains(&name) {
            r.kv_usage = Some(r.kv_usage.unwrap_or(0.0).max(v.min(1.0)));
        } else if name == "vllm:cache_config_info" {
            // One sample per DP rank, each with the rank's blocks: the smallest binds.
            let blocks = label(line, "num_gpu_blocks").and_then(|b| b.parse::<u64>().ok());
            if let Some(b) = blocks {
                r.capacity_blocks = Some(r.capacity_blocks.map_or(b, |c| c.min(b)));
            }
        }
    }
    r.running = running.round() as usize;
    r.waiting = waiting.round() as usize;
    seen.then_some(r)
}

/// The value of label `name` in a Prometheus sample line, unescaped quotes not handled (the
/// labels read here are numbers).
fn label<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let labels = &line[line.find('{')? + 1..line.find('}')?];
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == name).then(|| v.trim().trim_matches('"'))
    })
}

/// Requests an engine runs or queues, from its Prometheus text `metrics` (vLLM's
/// `vllm:num_requests_running` and `vllm:num_requests_waiting`, SGLang's `num_running_reqs`
/// and `num_queue_reqs` under either prefix): the sum of every sample of these gauges over
/// all label sets (one per DP rank or model), rounded. `None` when no such gauge appears (not
/// an engine we know, or an error page): the load is then unknown, not 0.
pub fn engine_requests(metrics: &str) -> Option<usize> {
    engine_report(metrics).map(|r| r.total())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM with two DP ranks (label `engine`), SGLang under both prefixes; other gauges,
    /// comments and malformed values are ignored.
    #[test]
    fn engine_requests_of_vllm_and_sglang() {
        let vllm = "# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2.0
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 3.0
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 4.0
vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 0.0
vllm:num_requests_running_extra{engine=\"0\"} 100.0
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5
";
        assert_eq!(engine_requests(vllm), Some(9));
        let old = "sglang:num_running_reqs{model_name=\"m\"} 7\nsglang:num_queue_reqs{model_name=\"m\"} 1\n";
        assert_eq!(engine_requests(old), Some(8));
        let new = "sglang_num_running_reqs 1\nsglang_num_queue_reqs{model_name=\"m\"} NaN\n";
        assert_eq!(engine_requests(new), Some(1));
        assert_eq!(
            engine_requests("vllm:num_requests_running{engine=\"0\"} 0.0\n"),
            Some(0)
        );
        assert_eq!(engine_requests("<html>502 Bad Gateway</html>"), None);
        assert_eq!(engine_requests("vllm:kv_cache_usage_perc 0.9\n"), None);
        assert_eq!(
            engine_report(vllm),
            Some(EngineReport {
                running: 5,
                waiting: 4,
                kv_usage: Some(0.5),
                ..EngineReport::default()
            })
        );
        assert_eq!(
            engine_report(old),
            Some(EngineReport {
                running: 7,
                waiting: 1,
                ..EngineReport::default()
            })
        );
        let info = "vllm:num_requests_running 1\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"36560\"} 1.0\n";
        assert_eq!(engine_report(info).unwrap().capacity_blocks, Some(36_560));
        assert_eq!(engine_report("vllm:kv_cache_usage_perc 0.9\n"), None);
    }
}
