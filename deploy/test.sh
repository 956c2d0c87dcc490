#!/usr/bin/env bash
# The test command (README's second command, and what CI runs): starts the local services,
# fetches the default model, installs the Python test clients, then runs every suite of the
# workspace in one cargo invocation against the real broker and Redis.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

"$ROOT/deploy/services.sh" up
# A fresh, empty broker for every run (see `kafka-reset` in services.sh).
"$ROOT/deploy/services.sh" kafka-reset
"$ROOT/deploy/fetch-model.sh"
echo "[test] installing Python test clients (deploy/requirements-test.txt)"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -r deploy/requirements-test.txt

export KAFKA_BROKERS="${KAFKA_BROKERS:-127.0.0.1:9092}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/}"
export RUST_BACKTRACE=1
# candle's CPU matmul re-reads /proc/cpuinfo on every call unless RAYON_NUM_THREADS is set (see
# `settle_cpu_threads` in model/src/device.rs, which the binaries call first thing). Test
# binaries have threads from the start, so the count is set here: the physical cores, which is
# what candle picks itself.
if [[ -z "${RAYON_NUM_THREADS:-}" ]]; then
  RAYON_NUM_THREADS="$({ lscpu -p=Core,Socket 2>/dev/null | grep -v '^#' | sort -u | wc -l; } || true)"
  [[ "$RAYON_NUM_THREADS" -gt 0 ]] || RAYON_NUM_THREADS="$(nproc)"
  export RAYON_NUM_THREADS
fi
# Kafka-backed tests use unique topics and consumer groups, so the two test threads of a
# binary never see each other's data; binaries run one after another (the outage test stops
# the broker and must be alone).
# The build takes ~4 GB under target/ (about 45 test binaries of 50-90 MB each); say what is left
# so a full disk is recognisable in the log.
df -h "$ROOT" 2>/dev/null | tail -1 | awk '{print "[test] disk free where target/ lives: " $4}' || true
cargo test --workspace --no-fail-fast "$@"
