#!/usr/bin/env bash
# Starts what the tests and the demo need on this machine: PostgreSQL and the tansu broker.
# Sourced by scripts/test and scripts/demo; safe to run again (it skips what is already up).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SERVICES_DIR="$ROOT/.services"
TANSU_VERSION="0.6.0"
TANSU_PORT="${TANSU_PORT:-9092}"
export OUTBOX_TEST_DATABASE_URL="${OUTBOX_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/outbox_test}"
export OUTBOX_TEST_KAFKA="${OUTBOX_TEST_KAFKA:-127.0.0.1:$TANSU_PORT}"
export PATH="$HOME/.cargo/bin:$PATH"
mkdir -p "$SERVICES_DIR"

log() { printf '[services] %s\n' "$*" >&2; }

# Polls `check` once a second for up to `seconds`; no fixed sleeps.
wait_for() {
  local what="$1" seconds="$2"; shift 2
  for _ in $(seq "$seconds"); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  log "$what did not become ready within ${seconds}s"
  return 1
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

ensure_postgres() {
  if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    log "installing PostgreSQL"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi
  if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    log "starting PostgreSQL"
    local version
    version="$(ls /etc/postgresql | sort -V | tail -n 1)"
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  fi
  wait_for "PostgreSQL" 60 pg_isready -q -h 127.0.0.1 -p 5432
  local db="${OUTBOX_TEST_DATABASE_URL##*/}"
  if ! psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'" | grep -q 1; then
    psql -h 127.0.0.1 -U postgres -qc "CREATE DATABASE \"$db\""
  fi
}

ensure_tansu_installed() {
  if cargo install --list | grep -q "^tansu v$TANSU_VERSION:"; then return 0; fi
  log "installing tansu $TANSU_VERSION from crates.io (about 15 minutes on 2 cores)"
  cargo install tansu --locked --version "$TANSU_VERSION" --features dynostore,libsql
}

# start_tansu [storage-url]: memory storage by default; pass sqlite://<dir>/tansu.db for a
# broker whose data must survive a restart.
start_tansu() {
  local storage="${1:-memory://tansu/}"
  ensure_tansu_installed
  if port_open "$TANSU_PORT"; then
    log "a broker already listens on 127.0.0.1:$TANSU_PORT"
    return 0
  fi
  log "starting tansu on 127.0.0.1:$TANSU_PORT ($storage)"
  nohup tansu broker \
    --listener-url "tcp://127.0.0.1:$TANSU_PORT" \
    --advertised-listener-url "tcp://127.0.0.1:$TANSU_PORT" \
    --storage-engine "$storage" \
    >"$SERVICES_DIR/tansu.log" 2>&1 &
  echo $! >"$SERVICES_DIR/tansu.pid"
  wait_for "tansu" 60 port_open "$TANSU_PORT" || { tail -n 50 "$SERVICES_DIR/tansu.log" >&2; return 1; }
}

ensure_services() {
  ensure_postgres
  start_tansu
}
