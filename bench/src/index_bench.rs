//! `kvroute bench index`: a short (< 60 s) benchmark run that writes its results as JSON.

/// Runs the benchmark and returns its JSON report.
///
/// # Errors
/// Not implemented yet: always an error until the index benchmark lands.
pub fn run() -> anyhow::Result<serde_json::Value> {
    anyhow::bail!("kvroute bench index is not implemented yet")
}
