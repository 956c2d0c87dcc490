# Shared by the scripts that start Hindsight's processes (deploy/up.sh, bench/learner_e2e.sh):
# messages, background processes stopped on exit, waiting for an HTTP endpoint.
# Source it after setting TAG (the message prefix) and LOGS (where the processes' logs go).

say() { printf '\n\033[1m[%s] %s\033[0m\n' "$TAG" "$*"; }
die() { printf '[%s] error: %s\n' "$TAG" "$*" >&2; exit 1; }

# Every background process started with `PIDS+=($!)` is stopped when the script exits.
PIDS=()
stop_all() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}

wait_http() { # url name seconds
  for _ in $(seq $(($3 * 5))); do
    curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
    sleep 0.2
  done
  die "$2 did not come up; see $LOGS/"
}
