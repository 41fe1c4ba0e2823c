//! The README's main job, shortened: `kvroute demo` on the embedded workload's first 30
//! requests, the text-mode tree against routing on KV events. Every request is served, the
//! JSON names both runs, prefix caching pays off in both, and after the events run the
//! router's event index equals every engine's real cache (zero phantom, zero missed blocks),
//! in the printed notes and in the run's `"kv_events"` JSON object.

use std::process::Command;

#[test]
fn short_demo_serves_everything_and_the_event_index_matches_the_engines() {
    let out = std::env::temp_dir().join(format!("kvroute-demo-{}.json", std::process::id()));
    let run = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "demo",
            "--max-requests",
            "30",
            "--policies",
            "cache_aware,cache_aware_events",
            "--quiet",
            "--out",
        ])
        .arg(&out)
        .output()
        .expect("kvroute runs");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&out).expect("demo wrote --out")).unwrap();
    let _ = std::fs::remove_file(&out);
    let runs = report["policies"].as_array().expect("policies array");
    let names: Vec<&str> = runs.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["cache_aware", "cache_aware_events"]);
    for r in runs {
        assert_eq!(
            (r["requests"].as_u64(), r["errors"].as_u64()),
            (Some(30), Some(0))
        );
        // Conversations come back for more turns: a cache-aware router must reuse prefixes.
        let hit = r["hit_rate"].as_f64().unwrap();
        assert!(hit > 0.3 && hit < 1.0, "{}: hit rate {hit}", r["policy"]);
    }
    // The events run carries its fault counters and the index-vs-engines comparison.
    assert!(runs[0].get("kv_events").is_none());
    let ev = &runs[1]["kv_events"];
    assert_eq!(
        (ev["phantom_blocks"].as_u64(), ev["missed_blocks"].as_u64()),
        (Some(0), Some(0)),
        "{ev}"
    );
    assert!(ev["cached_blocks"].as_u64().unwrap() > 0, "{ev}");
    assert!(ev["batches"].as_u64().unwrap() > 0, "{ev}");
    assert_eq!(ev["decode_errors"].as_u64(), Some(0), "{ev}");
    let drift = stdout
        .lines()
        .find(|l| l.contains("router index vs engines"))
        .unwrap_or_else(|| panic!("no drift line in:\n{stdout}"));
    assert!(drift.contains("phantom 0, missed 0 of "), "{drift}");
}
