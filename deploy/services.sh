#!/usr/bin/env bash
# Installs (if missing) and runs the local services Hindsight needs, on loopback only:
#   - a Kafka-protocol broker: tansu 0.6.0 (from crates.io) with its PostgreSQL storage engine, on a
#     private PostgreSQL cluster (Debian's postgresql) so it survives restarts. SQLite storage was
#     the default until 2026-12-06: it fell behind at 1,000 records/s and slowed as its file grew
#     (docs/experiments/2026-12-06-postgres-broker.md)
#   - Redis: Debian's redis-server
#   - Prometheus and promtool: Debian's prometheus (installed only; deploy/prometheus/ holds the
#     config, and tests/prometheus.rs starts its own instance against the processes it spawns)
#   - Chromium: Debian's chromium (installed only; tests/operator_page.rs drives the rollout
#     controller's operator page with it, headless)
#
# Usage: deploy/services.sh up|down|status|install|kafka-stop|kafka-kill|kafka-start|kafka-reset
# (kafka-kill SIGKILLs the broker process; its PostgreSQL keeps running, as a database would)
#
# Idempotent: `up` twice leaves one broker and one Redis running. It refuses to start a service
# on a port that something else already holds (a stale broker once silently served a test run).
# Production points Hindsight at its own Kafka and Redis; nothing here is assumed elsewhere.
#
# Environment:
#   HINDSIGHT_HOME   where binaries and state live (default /opt/hindsight)
#   KAFKA_PORT       broker port (default 9092)     REDIS_PORT   Redis port (default 6379)
#   PG_PORT          the broker's PostgreSQL port (default 5433; Debian's own cluster keeps 5432)
set -euo pipefail

HINDSIGHT_HOME=${HINDSIGHT_HOME:-/opt/hindsight}
KAFKA_PORT=${KAFKA_PORT:-9092}
REDIS_PORT=${REDIS_PORT:-6379}
PG_PORT=${PG_PORT:-5433}
TANSU_VERSION=0.6.0
# Built with the postgres engine (a build without it lives in tansu-$TANSU_VERSION).
TANSU_ROOT="$HINDSIGHT_HOME/tansu-$TANSU_VERSION-pg"
TANSU_BIN="$TANSU_ROOT/bin/tansu"
STATE="$HINDSIGHT_HOME/state"
KAFKA_DIR="$STATE/kafka"
REDIS_DIR="$STATE/redis"
PG_DIR="$STATE/pg"
HERE=$(cd "$(dirname "$0")" && pwd)
BROKER_DB="postgres://postgres@127.0.0.1:$PG_PORT/tansu"

say() { printf '[services] %s\n' "$*"; }
die() { printf '[services] error: %s\n' "$*" >&2; exit 1; }

# pid of the process listening on 127.0.0.1:$1 (empty if none)
listener_pid() {
  ss -Hltnp "sport = :$1" 2>/dev/null | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -n1
}
port_busy() { [ -n "$(ss -Hltn "sport = :$1" 2>/dev/null)" ]; }
pid_alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
pidfile_pid() { [ -f "$1" ] && cat "$1" || true; }

install_redis() {
  if command -v redis-server >/dev/null 2>&1; then
    say "redis-server present: $(redis-server --version | cut -d' ' -f3)"
    return
  fi
  say "installing redis-server from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq redis-server >/dev/null 2>&1 || {
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  }
  # The package may start its own instance on 6379; we run ours with our own config.
  if command -v systemctl >/dev/null 2>&1; then systemctl stop redis-server 2>/dev/null || true; fi
  pkill -f '^/usr/bin/redis-server 127.0.0.1:6379' 2>/dev/null || true
}

install_prometheus() {
  if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    say "prometheus present: $(prometheus --version 2>&1 | head -n1 | cut -d' ' -f3)"
    return
  fi
  say "installing prometheus (and promtool) from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  # Without recommends: the node exporter is not ours to run.
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || {
    apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  }
  # The package may start its own server on :9090 (scraping nothing of ours); stop it. Ours is
  # started with our config by whoever needs it (tests/prometheus.rs, deploy/README.md).
  if command -v systemctl >/dev/null 2>&1; then systemctl stop prometheus 2>/dev/null || true; fi
  if command -v service >/dev/null 2>&1; then service prometheus stop >/dev/null 2>&1 || true; fi
  local pid
  pid=$(listener_pid 9090)
  if [ -n "$pid" ] && [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = /usr/bin/prometheus ]; then
    kill "$pid" 2>/dev/null || true
  fi
}

install_chromium() {
  if command -v chromium >/dev/null 2>&1; then
    say "chromium present: $(chromium --version 2>/dev/null | head -n1)"
    return
  fi
  say "installing chromium (headless, for tests/operator_page.rs) from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || {
    apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null
  }
}

install_tansu() {
  if [ -x "$TANSU_BIN" ]; then
    say "tansu $TANSU_VERSION present at $TANSU_BIN"
    return
  fi
  command -v cargo >/dev/null 2>&1 || die "cargo is needed to install tansu"
  say "installing tansu $TANSU_VERSION from crates.io into $TANSU_ROOT (8-9 minutes on 2 cores, once)"
  mkdir -p "$TANSU_ROOT"
  cargo install tansu --version "$TANSU_VERSION" --locked --no-default-features \
    --features dynostore,libsql,postgres --root "$TANSU_ROOT" --quiet
  [ -x "$TANSU_BIN" ] || die "tansu install finished but $TANSU_BIN is missing"
}

# Debian's PostgreSQL binaries (newest major installed).
pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1; }

install_postgres() {
  if [ -x "$(pg_bin)/initdb" ]; then
    say "postgresql present: $("$(pg_bin)/postgres" --version | cut -d' ' -f3)"
    return
  fi
  say "installing postgresql from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq postgresql >/dev/null 2>&1 || {
    apt-get update -qq && apt-get install -y -qq postgresql >/dev/null
  }
  [ -x "$(pg_bin)/initdb" ] || die "postgresql installed but no initdb under /usr/lib/postgresql/*/bin"
}

# PostgreSQL refuses to run as root: as root, its commands run as the postgres user.
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
psql_pg() { "$(pg_bin)/psql" -h 127.0.0.1 -p "$PG_PORT" -U postgres -v ON_ERROR_STOP=1 -qAt "$@"; }
pg_answers() { "$(pg_bin)/pg_isready" -h 127.0.0.1 -p "$PG_PORT" -q 2>/dev/null; }

# The broker's database with tansu's schema (deploy/tansu/pg-schema.sql), created once.
ensure_broker_db() {
  if [ "$(psql_pg -d postgres -c "select 1 from pg_database where datname = 'tansu'")" != 1 ]; then
    say "creating the broker's database (tansu schema $TANSU_VERSION)"
    psql_pg -d postgres -c "create database tansu" >/dev/null
    psql_pg -d tansu -f "$HERE/tansu/pg-schema.sql" >/dev/null
  fi
}

start_postgres() {
  local bin; bin=$(pg_bin)
  if [ ! -f "$PG_DIR/PG_VERSION" ]; then
    mkdir -p "$PG_DIR"
    if [ "$(id -u)" = 0 ]; then chown postgres:postgres "$PG_DIR"; fi
    say "creating the broker's PostgreSQL cluster in $PG_DIR"
    as_pg "$bin/initdb" -D "$PG_DIR" -A trust -U postgres >"$STATE/pg-initdb.log" 2>&1 || {
      tail -n 20 "$STATE/pg-initdb.log" >&2
      die "initdb failed (log: $STATE/pg-initdb.log)"
    }
  fi
  if pg_answers; then
    say "postgresql already running (127.0.0.1:$PG_PORT)"
  else
    if port_busy "$PG_PORT"; then
      die "port $PG_PORT is held by another process (pid $(listener_pid "$PG_PORT")); refusing to start PostgreSQL there. Stop it or set PG_PORT."
    fi
    say "starting postgresql on 127.0.0.1:$PG_PORT (data in $PG_DIR)"
    as_pg "$bin/pg_ctl" -D "$PG_DIR" -l "$PG_DIR/postgresql.log" -w -t 60 \
      -o "-p $PG_PORT -c listen_addresses=127.0.0.1 -k $PG_DIR" start >/dev/null || {
      tail -n 20 "$PG_DIR/postgresql.log" >&2 || true
      die "postgresql did not start (log: $PG_DIR/postgresql.log)"
    }
  fi
  ensure_broker_db
}

stop_postgres() {
  if [ -f "$PG_DIR/postmaster.pid" ]; then
    say "stopping postgresql"
    as_pg "$(pg_bin)/pg_ctl" -D "$PG_DIR" -m fast -w stop >/dev/null || true
  else
    say "postgresql not running"
  fi
}

kafka_answers() {
  timeout 10 "$TANSU_BIN" topic list --broker "tcp://127.0.0.1:$KAFKA_PORT" >/dev/null 2>&1
}

redis_answers() {
  [ "$(timeout 5 redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null)" = "PONG" ]
}

wait_for() { # name check-fn seconds
  local name=$1 check=$2 secs=$3 i
  for ((i = 0; i < secs * 5; i++)); do
    if $check; then say "$name answers"; return 0; fi
    sleep 0.2
  done
  return 1
}

start_kafka() {
  mkdir -p "$KAFKA_DIR"
  local pid; pid=$(pidfile_pid "$KAFKA_DIR/tansu.pid")
  if pid_alive "$pid" && [ "$(listener_pid "$KAFKA_PORT")" = "$pid" ]; then
    if kafka_answers; then
      say "broker already running (pid $pid, 127.0.0.1:$KAFKA_PORT)"
      return
    fi
    # tansu's storage task can die while the process lives on (it then refuses every
    # request); a broker that does not answer is restarted, its data kept.
    say "broker (pid $pid) is running but not answering; restarting it"
    stop_kafka
    mkdir -p "$KAFKA_DIR"
  fi
  if port_busy "$KAFKA_PORT"; then
    die "port $KAFKA_PORT is held by another process (pid $(listener_pid "$KAFKA_PORT")); refusing to start a broker there. Stop it or set KAFKA_PORT."
  fi
  start_postgres
  say "starting tansu broker on 127.0.0.1:$KAFKA_PORT (storage $BROKER_DB)"
  (
    cd "$KAFKA_DIR"
    RUST_LOG=${TANSU_LOG:-warn} nohup "$TANSU_BIN" broker \
      --listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
      --advertised-listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
      --storage-engine "$BROKER_DB" \
      >>"$KAFKA_DIR/tansu.log" 2>&1 &
    echo $! >"$KAFKA_DIR/tansu.pid"
  )
  wait_for "broker" kafka_answers 60 || {
    tail -n 20 "$KAFKA_DIR/tansu.log" >&2 || true
    die "broker did not answer within 60 s (log: $KAFKA_DIR/tansu.log)"
  }
}

stop_kafka() {
  local pid; pid=$(pidfile_pid "$KAFKA_DIR/tansu.pid")
  if pid_alive "$pid"; then
    say "stopping broker (pid $pid)"
    kill "$pid"
    for _ in $(seq 50); do pid_alive "$pid" || break; sleep 0.1; done
    pid_alive "$pid" && kill -9 "$pid" 2>/dev/null || true
  else
    say "broker not running"
  fi
  rm -f "$KAFKA_DIR/tansu.pid"
}

# SIGKILL, no clean stop: what a crashed broker looks like to its clients (tests/outage.rs).
kill_kafka() {
  local pid; pid=$(pidfile_pid "$KAFKA_DIR/tansu.pid")
  if pid_alive "$pid"; then
    say "killing broker (pid $pid) with SIGKILL"
    kill -9 "$pid"
    for _ in $(seq 50); do pid_alive "$pid" || break; sleep 0.1; done
  else
    say "broker not running"
  fi
  rm -f "$KAFKA_DIR/tansu.pid"
}

start_redis() {
  mkdir -p "$REDIS_DIR"
  local pid; pid=$(pidfile_pid "$REDIS_DIR/redis.pid")
  if pid_alive "$pid" && [ "$(listener_pid "$REDIS_PORT")" = "$pid" ]; then
    say "redis already running (pid $pid, 127.0.0.1:$REDIS_PORT)"
    return
  fi
  if port_busy "$REDIS_PORT"; then
    die "port $REDIS_PORT is held by another process (pid $(listener_pid "$REDIS_PORT")); refusing to start Redis there. Stop it or set REDIS_PORT."
  fi
  say "starting redis on 127.0.0.1:$REDIS_PORT (data in $REDIS_DIR)"
  redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --dir "$REDIS_DIR" \
    --daemonize yes --pidfile "$REDIS_DIR/redis.pid" --logfile "$REDIS_DIR/redis.log" \
    --appendonly yes --save "" >/dev/null
  wait_for "redis" redis_answers 30 || die "redis did not answer within 30 s (log: $REDIS_DIR/redis.log)"
}

stop_redis() {
  local pid; pid=$(pidfile_pid "$REDIS_DIR/redis.pid")
  if pid_alive "$pid"; then
    say "stopping redis (pid $pid)"
    kill "$pid"
    for _ in $(seq 50); do pid_alive "$pid" || break; sleep 0.1; done
  else
    say "redis not running"
  fi
  rm -f "$REDIS_DIR/redis.pid"
}

# Stops the broker, deletes its data and starts it empty. The test command does this first:
# tests need no data from earlier runs (and earlier, SQLite storage slowed as its file grew).
reset_kafka() {
  stop_kafka
  start_postgres
  say "deleting the broker's data (database tansu)"
  psql_pg -d postgres -c "drop database if exists tansu with (force)" >/dev/null
  ensure_broker_db
  # Leftovers of the SQLite storage used before 2026-12-06.
  rm -f "$KAFKA_DIR"/tansu.db "$KAFKA_DIR"/tansu.db-shm "$KAFKA_DIR"/tansu.db-wal
  : >"$KAFKA_DIR/tansu.log" 2>/dev/null || true
  start_kafka
}

status() {
  local rc=0
  if pg_answers; then say "postgresql (the broker's storage): up on 127.0.0.1:$PG_PORT"; else say "postgresql (the broker's storage): down"; rc=1; fi
  if kafka_answers 2>/dev/null; then say "broker: up on 127.0.0.1:$KAFKA_PORT (pid $(listener_pid "$KAFKA_PORT"))"; else say "broker: down"; rc=1; fi
  if redis_answers; then say "redis:  up on 127.0.0.1:$REDIS_PORT (pid $(listener_pid "$REDIS_PORT"))"; else say "redis:  down"; rc=1; fi
  return $rc
}

case "${1:-}" in
  install) install_redis; install_prometheus; install_chromium; install_postgres; install_tansu ;;
  up) install_redis; install_prometheus; install_chromium; install_postgres; install_tansu; start_redis; start_kafka; say "KAFKA_BROKERS=127.0.0.1:$KAFKA_PORT REDIS_URL=redis://127.0.0.1:$REDIS_PORT/" ;;
  down) stop_kafka; stop_postgres; stop_redis ;;
  status) status ;;
  kafka-stop) stop_kafka ;;
  kafka-kill) kill_kafka ;;
  kafka-start) start_kafka ;;
  kafka-reset) install_postgres; install_tansu; reset_kafka ;;
  *) echo "usage: $0 up|down|status|install|kafka-stop|kafka-kill|kafka-start|kafka-reset" >&2; exit 2 ;;
esac
