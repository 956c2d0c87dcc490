#!/usr/bin/env bash
# The headline learning result through the shipped processes, not the bench harness: separate
# `hindsight serve`, `proxy`, `join` and `learner --config deploy/learner.example.toml` processes,
# the simulated environment sending the headline scenario through the proxy (64 feedback events,
# every wrong answer corrected, seed 0), one candidate after 64 trained examples, and the
# learner's own eval gate scoring it against the base model on the 60 held-out tickets the
# learning-curve bench uses. Only where things go is overridden (topics, keys, directories,
# ports, the candidate schedule); the recipe is the example file's.
#
#   bench/learner_e2e.sh            # ~30-40 min on 2 vCPUs; needs deploy/services.sh up
#
# Prints the gate's verdict (candidate and base exact match) and leaves the logs, the run log
# and the adapter under target/learner-e2e/<run>/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

EVENTS="${EVENTS:-64}"
EVAL_ITEMS="${EVAL_ITEMS:-60}"
RUN="e2e$(date +%s)"
W="target/learner-e2e/$RUN"
mkdir -p "$W/logs"
TAG=learner-e2e LOGS="$W/logs"
# shellcheck source=deploy/lib.sh
. deploy/lib.sh
MODEL="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$MODEL" ] || deploy/fetch-model.sh
cargo build --quiet --bin hindsight && cargo build --quiet -p hindsight-sim
BIN="$ROOT/target/debug/hindsight"
SIM="$ROOT/target/debug/hindsight-sim"
SECRET="learner-e2e-secret"
trap stop_all EXIT INT TERM

export HINDSIGHT_LOG__TOPIC_PREFIX="$RUN"
"$SIM" eval-set --n "$EVAL_ITEMS" --out "$W/eval.jsonl"

"$BIN" serve --model "$MODEL" --served-model-name SmolLM2-135M-Instruct --listen 127.0.0.1:18000 \
  >"$W/logs/serve.log" 2>&1 &
PIDS+=($!)
wait_http http://127.0.0.1:18000/v1/models "hindsight serve" 120
HINDSIGHT_FEEDBACK__SIGNING__SECRETS="[\"$SECRET\"]" \
  "$BIN" proxy --upstream http://127.0.0.1:18000 --listen 127.0.0.1:18080 --admin 127.0.0.1:19464 \
  --spill-dir "$W/spill" >"$W/logs/proxy.log" 2>&1 &
PIDS+=($!)
HINDSIGHT_JOINER__GROUP_ID="$RUN-join" HINDSIGHT_JOINER__REDIS_KEY_PREFIX="$RUN:join:" \
  "$BIN" join >"$W/logs/join.log" 2>&1 &
PIDS+=($!)
wait_http http://127.0.0.1:19464/readyz "hindsight proxy" 60

say "learner: deploy/learner.example.toml, one candidate after $EVENTS examples"
HINDSIGHT_LEARNER__BASE_MODEL_NAME=SmolLM2-135M-Instruct \
HINDSIGHT_LEARNER__GROUP_ID="$RUN-learner" \
HINDSIGHT_LEARNER__CHECKPOINT_DIR="$W/learner" \
HINDSIGHT_LEARNER__RUN_LOG="$W/learner/run.jsonl" \
HINDSIGHT_LEARNER__CANDIDATE_EVERY_EXAMPLES="$EVENTS" \
HINDSIGHT_LEARNER__CANDIDATE_EVERY_BATCHES=0 \
HINDSIGHT_LEARNER__CANDIDATE_EVERY_MS=0 \
HINDSIGHT_REGISTRY__KEY_PREFIX="$RUN:registry" \
HINDSIGHT_REGISTRY__ADAPTER_DIR="$W/adapters" \
HINDSIGHT_PUBLISH__ENDPOINTS='["http://127.0.0.1:18000/v1"]' \
HINDSIGHT_PUBLISH__GATE__EVAL_SET="$W/eval.jsonl" \
  "$BIN" learner -c deploy/learner.example.toml >"$W/logs/learner.log" 2>&1 &
LEARNER=$!
PIDS+=($LEARNER)

say "traffic: $EVENTS tickets answered by the base model, every wrong answer corrected"
started=$(date +%s)
"$SIM" run --agent http://127.0.0.1:18080/v1 --model SmolLM2-135M-Instruct --episodes "$EVENTS" \
  --rate 20 --concurrency 4 --temperature 0.7 --seed 0 --correction-rate 1 --noise-rate 0 \
  --feedback-in-order --feedback-delay-ms 100 --secret "$SECRET" --run-id "$RUN" \
  >"$W/logs/traffic.log" 2>&1 || die "the traffic failed; see $W/logs/traffic.log"
tail -3 "$W/logs/traffic.log"

say "waiting for the candidate and its gate (training, then ${EVAL_ITEMS} held-out tickets twice)"
until grep -q "Candidate published" "$W/logs/learner.log"; do
  kill -0 "$LEARNER" 2>/dev/null || die "the learner stopped; see $W/logs/learner.log"
  [ $(($(date +%s) - started)) -lt 5400 ] || die "no candidate after 90 min"
  sleep 10
done
say "done in $(($(date +%s) - started)) s; the candidate's run-log line and the registry:"
grep '"candidate"' "$W/learner/run.jsonl" | tail -1
"$BIN" adapters list --key-prefix "$RUN:registry"
