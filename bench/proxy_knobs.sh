#!/usr/bin/env bash
# A/B of `hindsight proxy` runtime settings: CPU per request (from /proc) and p99 at a fixed
# open-loop rate, non-streamed and streamed, each setting started fresh and measured back to back
# with the direct mock run before it. Uses the load generator (oha) and the 10 ms mock that
# `../shared/peers/proxy-baseline.sh --install-only` installs, and the local broker and Redis
# (`deploy/services.sh up`); the proxy is the release build (`cargo build --release --bin
# hindsight`).
#
#   bench/proxy_knobs.sh                                  # the settings of proxy/README.md
#   bench/proxy_knobs.sh "TOKIO_WORKER_THREADS=1" ...     # any env settings, one per argument
#
# Knobs (env): RATE=1000 STREAM_RATE=500 SECS=10 PEERS_OPT=/opt/peers PEERS_TMP=/tmp/peers
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OHA="${PEERS_OPT:-/opt/peers}/oha/bin/oha"
MOCK="${PEERS_TMP:-/tmp/peers}/mock-target/release/peer-mock-openai"
PROXY="$ROOT/target/release/hindsight"
RATE="${RATE:-1000}" STREAM_RATE="${STREAM_RATE:-500}" SECS="${SECS:-10}"
for f in "$OHA" "$MOCK" "$PROXY"; do
  [[ -x "$f" ]] || { echo "missing $f (see the header of $0)" >&2; exit 1; }
done
if [[ $# -eq 0 ]]; then
  set -- "" "TOKIO_WORKER_THREADS=1" "HINDSIGHT_LOG__LINGER_MS=50" \
    "HINDSIGHT_PROXY__EPISODE_SHARING=false" ""
fi
SPILL="$(mktemp -d)"
"$MOCK" --host 127.0.0.1 --port 18000 --delay-ms 10 --chunks 16 --chunk-delay-ms 0 --threads 1 \
  > "$SPILL/mock.log" 2>&1 &
MOCK_PID=$!
PROXY_PID=""
trap 'kill $MOCK_PID $PROXY_PID 2>/dev/null || true; rm -rf "$SPILL"' EXIT
sleep 1

body() {  # stream: true|false
  printf '{"model":"mock-model","stream":%s,"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Write a short story about a robot."}],"max_tokens":64}' "$1"
}
load() {  # url body rate secs -> "p99_ms answered"
  "$OHA" -z "${4}s" -q "$3" --latency-correction -c 100 --no-tui --output-format json -m POST \
    -H 'content-type: application/json' -H 'authorization: Bearer sk-bench' -d "$2" "$1" 2>/dev/null \
    | python3 -c 'import json,sys; d=json.load(sys.stdin); print("%.2f %d" % (d["latencyPercentiles"]["p99"]*1e3, sum(d["statusCodeDistribution"].values())))'
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
ticks_per_s="$(getconf CLK_TCK)"

for setting in "$@"; do
  # shellcheck disable=SC2086  # the setting is a list of NAME=value words
  env $setting RUST_LOG=warn HINDSIGHT_LOG__TOPIC_PREFIX="knobs$(date +%s%N)" "$PROXY" proxy \
    --listen 127.0.0.1:9000 --admin 127.0.0.1:9466 --upstream http://127.0.0.1:18000 \
    --kafka-brokers "${KAFKA_BROKERS:-127.0.0.1:9092}" --spill-dir "$SPILL/spill" \
    > "$SPILL/proxy.log" 2>&1 &
  PROXY_PID=$!
  sleep 2
  load http://127.0.0.1:9000/v1/chat/completions "$(body false)" 200 3 > /dev/null
  for mode in "false $RATE" "true $STREAM_RATE"; do
    read -r stream rate <<< "$mode"
    direct="$(load http://127.0.0.1:18000/v1/chat/completions "$(body "$stream")" "$rate" "$SECS")"
    t0="$(cpu_ticks "$PROXY_PID")"
    read -r p99 answered <<< "$(load http://127.0.0.1:9000/v1/chat/completions "$(body "$stream")" "$rate" "$SECS")"
    t1="$(cpu_ticks "$PROXY_PID")"
    us="$(( (t1 - t0) * 1000000 / ticks_per_s / (answered > 0 ? answered : 1) ))"
    echo "[${setting:-defaults}] stream=$stream rate=$rate: direct p99 ${direct%% *} ms, proxy p99 $p99 ms, proxy CPU $us us/request"
  done
  kill "$PROXY_PID"; wait "$PROXY_PID" 2>/dev/null || true
  PROXY_PID=""
done
