//! [`engine_requests`]: an engine's own load report, read from its `/metrics`. (The
//! per-request load token, `LoadGuard`, lives with the registry in [`crate::workers`].)

/// Running and waiting request gauges, by engine: vLLM (`vllm:num_requests_running`,
/// `vllm:num_requests_waiting`), SGLang up to v0.5.3 (`sglang:` prefix) and from v0.5.4
/// (`sglang_`). Source: engine-model.md §7.
const REQUEST_GAUGES: [&str; 6] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang_num_running_reqs",
    "sglang_num_queue_reqs",
];

/// Requests an engine runs or queues, from its Prometheus text `metrics` (vLLM's
/// `vllm:num_requests_running` and `vllm:num_requests_waiting`, SGLang's `num_running_reqs`
/// and `num_queue_reqs` under either prefix): the sum of every sample of these gauges over
/// all label sets (one per DP rank or model), rounded. `None` when no such gauge appears (not
/// an engine we know, or an error page): the load is then unknown, not 0.
pub fn engine_requests(metrics: &str) -> Option<usize> {
    let mut total = None;
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        if !REQUEST_GAUGES.contains(&&line[..name_end]) {
            continue;
        }
        let Some(v) = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
        else {
            continue;
        };
        *total.get_or_insert(0.0) += v;
    }
    total.map(|t: f64| t.round() as usize)
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
    }
}
