#!/usr/bin/env bash
# A canary rollout by hand, against the processes deploy/up.sh runs (proxy :8080 with the route
# `support`, the rollout controller with its admin API on :9466, hindsight serve :8000).
#   examples/canary/walkthrough.sh [VERSION]     # default: the newest support@N serve has
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="$ROOT/target/debug/hindsight"
CFG="$ROOT/.hindsight/rollout.toml"
TOKEN="${HINDSIGHT_ADMIN_TOKEN:-local-demo-admin-token}"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
[ -f "$CFG" ] || { echo "run deploy/up.sh first (it writes $CFG and starts the controller)"; exit 1; }

VERSION="${1:-$(curl -fsS http://127.0.0.1:8000/v1/models | python3 -c '
import json,sys
ids=[m["id"] for m in json.load(sys.stdin)["data"] if m["id"].startswith("support@")]
print(sorted(ids, key=lambda i: int(i.split("@")[1]))[-1] if ids else "")')}"
[ -n "$VERSION" ] || { echo "no support@N adapter is loaded yet: wait for the learner's first candidate"; exit 1; }

step "1. the route as the controller sees it"
"$BIN" rollout -c "$CFG" status support || true

step "2. start a canary of $VERSION (refused while another runs: then it is queued)"
"$BIN" rollout -c "$CFG" --by walkthrough --reason "manual canary" start support "$VERSION" \
  --stages 0.2,0.5,1.0 --endpoint http://127.0.0.1:8000/v1 || true

step "3. ten users through the proxy: each sticks to one version (x-hindsight-adapter)"
for u in $(seq 1 10); do
  v=$(curl -sS -o /dev/null -D - http://127.0.0.1:8080/v1/chat/completions \
    -H 'content-type: application/json' -H "x-hindsight-user: user-$u" \
    -d '{"model":"support","max_tokens":8,"messages":[{"role":"user","content":"Hello"}]}' \
    | tr -d '\r' | awk -F': ' 'tolower($1)=="x-hindsight-adapter"{print $2}')
  echo "user-$u -> $v"
done

step "4. pin user-1 to the canary, then watch status for a while"
"$BIN" rollout -c "$CFG" pin support user-1 "$VERSION" || true
sleep 10
"$BIN" rollout -c "$CFG" status support

step "5. force a rollback through the admin API (bearer token)"
curl -sS -X POST http://127.0.0.1:9466/v1/rollouts/support -H "authorization: Bearer $TOKEN" \
  -H 'content-type: application/json' -d '{"action":"rollback","by":"walkthrough","reason":"forced rollback"}' \
  | python3 -c 'import json,sys; r=json.load(sys.stdin); print(r.get("audit") or r)'

step "6. the audit trail"
"$BIN" rollout -c "$CFG" unpin support user-1 || true
"$BIN" rollout -c "$CFG" history support
