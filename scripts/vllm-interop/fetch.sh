#!/usr/bin/env bash
# Fetches vLLM's real KV-event publisher for the interop test (io/tests/vllm_interop.rs):
# downloads the vLLM wheel without installing it (`pip download --no-deps`), extracts only
# `vllm/distributed/kv_events.py` into the cache directory, deletes the wheel (~340 MB), and
# installs the two libraries that file needs (msgspec, pyzmq). Reruns with the file cached
# need no network.
#
# Env: VLLM_VERSION (default below; "latest" = newest on PyPI), KVROUTE_INTEROP_DIR (cache dir,
# default target/vllm-interop). Prints the path of kv_events.py on success.
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
DIR="${KVROUTE_INTEROP_DIR:-target/vllm-interop}"
FILE="$DIR/vllm/distributed/kv_events.py"
PY="${PYTHON:-python3}"

if ! "$PY" -c 'import msgspec, zmq' 2>/dev/null; then
  # PEP 668 distributions refuse system-wide installs; fall back to the user site.
  "$PY" -m pip install --quiet msgspec pyzmq >&2 \
    || "$PY" -m pip install --quiet --user --break-system-packages msgspec pyzmq >&2
fi

if [ ! -f "$FILE" ]; then
  spec="vllm==$VLLM_VERSION"
  [ "$VLLM_VERSION" = latest ] && spec=vllm
  tmp="$DIR/wheel.tmp"
  rm -rf "$tmp" && mkdir -p "$tmp"
  start=$(date +%s)
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "$spec" >&2
  whl=$(ls "$tmp"/vllm-*.whl | head -n 1)
  echo "fetched $(basename "$whl") ($(du -m "$whl" | cut -f1) MB) in $(( $(date +%s) - start )) s" >&2
  "$PY" - "$whl" "$DIR" <<'PYEOF'
import sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    z.extract("vllm/distributed/kv_events.py", out)
PYEOF
  basename "$whl" > "$DIR/WHEEL"
  rm -rf "$tmp"
fi
echo "$FILE"
