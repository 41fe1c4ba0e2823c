//! `kvroute bench tokenize`: a short (< 60 s) benchmark run that writes its results as JSON.

/// Runs the benchmark and returns its JSON report.
///
/// # Errors
/// Not implemented yet: always an error until the tokenize benchmark lands.
pub fn run() -> anyhow::Result<serde_json::Value> {
    anyhow::bail!("kvroute bench tokenize is not implemented yet")
}
