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

# The newest installed cluster version (Debian's layout: /etc/postgresql/<version>/main).
pg_version() { ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1; }

# Trust on loopback (tests and the demo connect as postgres without a password; Debian's
# default pg_hba.conf asks for one on 127.0.0.1) and logical WAL for Debezium. Returns 0 when
# it changed a file, so the caller knows a restart is due.
configure_postgres() {
  local conf="/etc/postgresql/$1/main" changed=1
  local settings="$conf/conf.d/outbox.conf"
  local wanted
  wanted="$(cat <<'CONF'
# Written by outbox's scripts/services.sh: settings for tests, the demo and Debezium.
listen_addresses = '127.0.0.1'
wal_level = logical
max_replication_slots = 32
max_wal_senders = 32
max_connections = 300
CONF
)"
  if [ "$(cat "$settings" 2>/dev/null)" != "$wanted" ]; then
    mkdir -p "$conf/conf.d"
    printf '%s\n' "$wanted" >"$settings"
    changed=0
  fi
  # pg_hba.conf is first match wins: the trust lines go on top, once.
  if ! grep -q '^# outbox: trust on loopback' "$conf/pg_hba.conf"; then
    local hba
    hba="$(mktemp)"
    {
      echo '# outbox: trust on loopback (tests and demo only; never on a shared machine)'
      echo 'host    all             all             127.0.0.1/32            trust'
      echo 'host    all             all             ::1/128                 trust'
      echo 'host    replication     all             127.0.0.1/32            trust'
      echo 'host    replication     all             ::1/128                 trust'
      cat "$conf/pg_hba.conf"
    } >"$hba"
    cat "$hba" >"$conf/pg_hba.conf"
    rm -f "$hba"
    changed=0
  fi
  return "$changed"
}

ensure_postgres() {
  if [ -z "$(pg_version)" ] || ! command -v pg_ctlcluster >/dev/null 2>&1; then
    log "installing PostgreSQL from Debian's packages"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi
  local version
  version="$(pg_version)"
  if configure_postgres "$version" && pg_isready -q -h 127.0.0.1 -p 5432; then
    log "restarting PostgreSQL $version to apply its settings"
    pg_ctlcluster --skip-systemctl-redirect "$version" main restart
  fi
  if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    log "starting PostgreSQL $version"
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  fi
  wait_for "PostgreSQL" 60 pg_isready -q -h 127.0.0.1 -p 5432
  local wal
  wal="$(psql -h 127.0.0.1 -U postgres -tAc 'SHOW wal_level')"
  if [ "$wal" != logical ]; then
    log "PostgreSQL runs with wal_level=$wal; expected logical"
    return 1
  fi
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
