#!/usr/bin/env bash
# The test command of the README: formatting, lints, then every test of the workspace.
# Tests start simulated engines and the gateway in-process on loopback; trace tests read
# ../shared/data (beside the repo) and skip with a notice when it is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The gateway-only binary: io's library and `kvroute serve` build without the bench crate.
cargo build -p kvroute-io --no-default-features --bin kvroute
cargo test --workspace
