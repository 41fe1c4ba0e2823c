//! The README's main job, shortened: `kvroute demo` on the embedded workload's first 30
//! requests, the text-mode tree against routing on KV events. Every request is served, the
//! JSON names both runs, prefix caching pays off in both, and after the events run the
//! router's event index equals every engine's real cache (zero phantom, zero missed blocks),
//! in the printed notes and in the run's `"kv_events"` JSON object. Then the same with two
//! router replicas behind a round-robin balancer, where only events see every engine's cache.

use std::process::Command;

/// Runs `kvroute demo --max-requests 30 --policies cache_aware,cache_aware_events --quiet`
/// with `extra` flags; returns its stdout and `--out` JSON.
fn demo(extra: &[&str]) -> (String, serde_json::Value) {
    let out = std::env::temp_dir().join(format!(
        "kvroute-demo-{}-{}.json",
        std::process::id(),
        extra.join("")
    ));
    let run = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "demo",
            "--max-requests",
            "30",
            "--policies",
            "cache_aware,cache_aware_events",
            "--quiet",
        ])
        .args(extra)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("kvroute runs");
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(
        run.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report = serde_json::from_slice(&std::fs::read(&out).expect("demo wrote --out")).unwrap();
    let _ = std::fs::remove_file(&out);
    (stdout, report)
}

#[test]
fn short_demo_serves_everything_and_the_event_index_matches_the_engines() {
    let (stdout, report) = demo(&[]);
    let runs = report["policies"].as_array().expect("policies array");
    let names: Vec<&str> = runs.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["cache_aware", "cache_aware_events"]);
    for r in runs {
        assert_eq!(
            (r["requests"].as_u64(), r["errors"].as_u64()),
            (Some(30), Some(0))
        );
        // On hits, the router's prediction against the engines' `cached_tokens` (B37): the
        // counters balance, and the engines served something on hits.
        let h = &r["hit_tokens"];
        let n = |k: &str| h[k].as_i64().unwrap_or_else(|| panic!("{k} in {h}"));
        assert_eq!(
            n("predicted") - n("served"),
            n("phantom") - n("unannounced"),
            "{h}"
        );
        assert!(n("served") > 0 && n("predicted") > 0, "{h}");
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
    // The demo's simulated reading is `kvroute simulate` on the same workload and fleet.
    let sim = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["simulate", "--max-requests", "30", "--policies"])
        .arg("cache_aware,cache_aware_events")
        .output()
        .expect("kvroute runs");
    assert!(sim.status.success());
    let table = String::from_utf8_lossy(&sim.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("simulated on a virtual clock"))
        .unwrap_or_else(|| panic!("no simulated line in:\n{stdout}"));
    for r in runs {
        let name = r["policy"].as_str().unwrap();
        let h = r["simulated_hit_rate"].as_f64().unwrap() * 100.0;
        assert!(line.contains(&format!("{name} {h:.1} %")), "{line}");
        let row = table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} in:\n{table}"));
        assert_eq!(
            row.split_whitespace().nth(3),
            Some(format!("{h:.1}").as_str()),
            "{row}"
        );
    }
}

/// Two replicas, request k to replica k mod 2: a conversation's next turn usually reaches the
/// replica that did not route its last one. That replica's tree has never seen the
/// conversation (a miss, recomputed elsewhere), while both replicas' event indexes hold every
/// engine's blocks. Measured in release: 41.5–45.1 % against 55.8–56.1 % (3 runs).
#[test]
fn with_two_replicas_only_events_keep_conversations_on_their_worker() {
    let (stdout, report) = demo(&["--replicas", "2"]);
    let runs = report["policies"].as_array().expect("policies array");
    let hit = |i: usize| runs[i]["hit_rate"].as_f64().unwrap();
    for r in runs {
        assert_eq!(
            (r["requests"].as_u64(), r["errors"].as_u64()),
            (Some(30), Some(0))
        );
    }
    assert!(hit(1) > hit(0) + 0.05, "tree {} events {}", hit(0), hit(1));
    // Summed over both replicas: each one's index equals the engines.
    let ev = &runs[1]["kv_events"];
    assert_eq!(
        (ev["phantom_blocks"].as_u64(), ev["missed_blocks"].as_u64()),
        (Some(0), Some(0)),
        "{ev}"
    );
    assert!(
        stdout.contains(
            "router index (each of 2 replicas) vs engines after the run: phantom 0, missed 0 of "
        ),
        "{stdout}"
    );
}
