#!/usr/bin/env bash
# The PostgreSQL cluster of this checkout, for the tests, the demo and the benchmarks: made with
# `initdb` in .services/postgres/ from Debian's binaries (the `postgresql` package, installed
# if missing), started and stopped with `pg_ctl`. No other cluster on the machine is read,
# configured, started or stopped (Debian's `main` on 5432 may run beside it, untouched).
#
#   port          $OUTBOX_PG_PORT (default 54329), on 127.0.0.1 only
#   TCP           TLS only (hostssl), scram-sha-256 passwords; the server certificate is
#                 scripts/tls.sh's (.services/tls/server.pem, for localhost and 127.0.0.1)
#   superuser     $OUTBOX_PG_USER (default outbox), its password generated once into
#                 .services/postgres/password (mode 600)
#   unix socket   .services/postgres/socket/ (mode 700: only the server's user and root, or
#                 this checkout's user, reach it), `trust` there: the scripts' own psql
#   files         data/, postgres.log, password, socket/ under .services/postgres/
#
# initdb refuses to run as root: as root the server runs as the `postgres` user (Debian's
# package creates it), which owns data/ and socket/; as anyone else, as that user.
# Sourced by scripts/services.sh. `ensure_postgres` starts the cluster (making it first if
# needed) and the test database; `stop_postgres` stops it; `pg` runs a client on its socket.

PG_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PG_DIR="$PG_ROOT/.services/postgres"
PG_DATA="$PG_DIR/data"
PG_SOCKET_DIR="$PG_DIR/socket"
PG_PASSWORD_FILE="$PG_DIR/password"
export OUTBOX_PG_PORT="${OUTBOX_PG_PORT:-54329}"
export OUTBOX_PG_USER="${OUTBOX_PG_USER:-outbox}"
# The test database's name when OUTBOX_TEST_DATABASE_URL is the scripts' default.
PG_TEST_DB=outbox_test
# Whether OUTBOX_TEST_DATABASE_URL is ours to set (unset by the caller).
PG_DEFAULT_URL="${OUTBOX_TEST_DATABASE_URL:+no}"
PG_DEFAULT_URL="${PG_DEFAULT_URL:-yes}"

declare -F ensure_tls >/dev/null || source "$PG_ROOT/scripts/tls.sh"

pg_log() { printf '[postgres] %s\n' "$*" >&2; }

# The newest Debian server binaries (/usr/lib/postgresql/<version>/bin).
pg_bin() {
  local dir
  dir="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
  [ -n "$dir" ] && [ -x "$dir/initdb" ] && echo "$dir"
}

pg_as_root() { [ "$(id -u)" = 0 ]; }

# Runs a server command as the server's user.
pg_server_cmd() {
  if pg_as_root; then runuser -u postgres -- "$@"; else "$@"; fi
}

# pg TOOL ARGS...: a client (psql, pgbench, pg_isready...) on the cluster's own socket, as its
# superuser: no password, no TCP. `pg psql -d outbox_test -qAtc 'SELECT 1'`.
pg() {
  local tool="$1"
  shift
  "$tool" -h "$PG_SOCKET_DIR" -p "$OUTBOX_PG_PORT" -U "$OUTBOX_PG_USER" "$@"
}

# The database named by OUTBOX_TEST_DATABASE_URL (its path, without the query).
test_database_name() {
  local url="${OUTBOX_TEST_DATABASE_URL%%\?*}"
  echo "${url##*/}"
}

# The default test URL: TLS verified against the scripts' authority, by host name.
pg_default_url() {
  local password ca
  password="$(cat "$PG_PASSWORD_FILE")"
  ca="$(python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe="/"))' "$PG_ROOT/.services/tls/ca.pem")"
  echo "postgres://$OUTBOX_PG_USER:$password@localhost:$OUTBOX_PG_PORT/$PG_TEST_DB?sslmode=verify-full&sslrootcert=$ca"
}

pg_export_url() {
  if [ "$PG_DEFAULT_URL" = yes ] && [ -s "$PG_PASSWORD_FILE" ]; then
    export OUTBOX_TEST_DATABASE_URL
    OUTBOX_TEST_DATABASE_URL="$(pg_default_url)"
  fi
}

pg_settings() {
  cat <<CONF
# Written by outbox's scripts/postgres.sh (rewritten on every start).
listen_addresses = '127.0.0.1'
port = $OUTBOX_PG_PORT
unix_socket_directories = '$PG_SOCKET_DIR'
unix_socket_permissions = 0700
ssl = on
ssl_cert_file = 'server.pem'
ssl_key_file = 'server.key'
password_encryption = 'scram-sha-256'
wal_level = logical
max_replication_slots = 32
max_wal_senders = 32
max_connections = 300
CONF
}

# First match wins. TCP: TLS and a password, for every user and for replication (Debezium);
# a connection without TLS matches no line and is refused. The socket: trust.
pg_hba() {
  cat <<'HBA'
# Written by outbox's scripts/postgres.sh (rewritten on every start).
# TYPE  DATABASE     USER  ADDRESS       METHOD
local   all          all                 trust
local   replication  all                 trust
hostssl all          all   127.0.0.1/32  scram-sha-256
hostssl all          all   ::1/128       scram-sha-256
hostssl replication  all   127.0.0.1/32  scram-sha-256
hostssl replication  all   ::1/128       scram-sha-256
HBA
}

# pg_write_owned FILE MODE: stdin into FILE (in the data directory), owned by the server's
# user with MODE, only when its content changed. Returns 0 when it wrote.
pg_write_owned() {
  local file="$1" mode="$2" tmp
  tmp="$(mktemp)"
  cat >"$tmp"
  if [ -f "$file" ] && cmp -s "$tmp" "$file"; then rm -f "$tmp"; return 1; fi
  if pg_as_root; then
    install -m "$mode" -o postgres -g postgres "$tmp" "$file"
  else
    install -m "$mode" "$tmp" "$file"
  fi
  rm -f "$tmp"
}

pg_init() {
  local bin="$1"
  pg_log "making the checkout's PostgreSQL cluster in $PG_DATA"
  mkdir -p "$PG_DIR"
  chmod 755 "$PG_DIR"
  if pg_as_root; then
    install -d -m 700 -o postgres -g postgres "$PG_DATA"
    # The server's user must reach .services/postgres: a checkout under a private home
    # (/root) is out of its reach, and the scripts change no directory they did not make.
    if ! runuser -u postgres -- test -x "$PG_DIR"; then
      pg_log "the postgres user cannot reach $PG_DIR (a parent directory is private); put the checkout where it can"
      return 1
    fi
  else
    install -d -m 700 "$PG_DATA"
  fi
  pg_server_cmd "$bin/initdb" -D "$PG_DATA" -U "$OUTBOX_PG_USER" -A trust -E UTF8 \
    --locale=C.UTF-8 --no-sync >"$PG_DIR/initdb.log" 2>&1 \
    || { cat "$PG_DIR/initdb.log" >&2; return 1; }
  echo "include 'outbox.conf'" | pg_server_cmd tee -a "$PG_DATA/postgresql.conf" >/dev/null
}

pg_running() { pg_server_cmd "$1/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1; }

ensure_postgres() {
  local bin
  if ! bin="$(pg_bin)"; then
    pg_log "installing PostgreSQL from Debian's packages"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    bin="$(pg_bin)"
  fi
  ensure_tls
  [ -s "$PG_DATA/PG_VERSION" ] || pg_init "$bin"
  if [ ! -s "$PG_PASSWORD_FILE" ]; then
    (umask 077 && openssl rand -hex 24 >"$PG_PASSWORD_FILE")
  fi
  if pg_as_root; then
    install -d -m 700 -o postgres -g postgres "$PG_SOCKET_DIR"
    # The server writes its log; .services/postgres itself stays this checkout's user's.
    [ -e "$PG_DIR/postgres.log" ] || install -m 640 -o postgres -g postgres /dev/null "$PG_DIR/postgres.log"
  else
    install -d -m 700 "$PG_SOCKET_DIR"
  fi
  local restart=1 reload=1
  pg_settings | pg_write_owned "$PG_DATA/outbox.conf" 600 && restart=0
  pg_hba | pg_write_owned "$PG_DATA/pg_hba.conf" 600 && reload=0
  pg_write_owned "$PG_DATA/server.pem" 600 <"$PG_ROOT/.services/tls/server.pem" && reload=0
  pg_write_owned "$PG_DATA/server.key" 600 <"$PG_ROOT/.services/tls/server.key" && reload=0
  if pg_running "$bin"; then
    if [ "$restart" = 0 ]; then
      pg_log "restarting the checkout's PostgreSQL to apply its settings"
      pg_server_cmd "$bin/pg_ctl" -D "$PG_DATA" -l "$PG_DIR/postgres.log" -w -t 60 -m fast restart >/dev/null \
        || { tail -n 30 "$PG_DIR/postgres.log" >&2; return 1; }
    elif [ "$reload" = 0 ]; then
      pg_server_cmd "$bin/pg_ctl" -D "$PG_DATA" reload >/dev/null
    fi
  else
    pg_log "starting the checkout's PostgreSQL on 127.0.0.1:$OUTBOX_PG_PORT ($PG_DIR)"
    pg_server_cmd "$bin/pg_ctl" -D "$PG_DATA" -l "$PG_DIR/postgres.log" -w -t 60 start >/dev/null \
      || { tail -n 30 "$PG_DIR/postgres.log" >&2; return 1; }
  fi
  # The password goes in on stdin (not in any process's arguments); the server keeps its
  # SCRAM verifier only.
  pg psql -X -q -v ON_ERROR_STOP=1 -d postgres >/dev/null <<SQL
SET log_statement = 'none';
ALTER ROLE "$OUTBOX_PG_USER" PASSWORD '$(cat "$PG_PASSWORD_FILE")';
SQL
  pg_export_url
  if [ "$PG_DEFAULT_URL" = no ]; then
    pg_log "OUTBOX_TEST_DATABASE_URL was set by the caller: the tests use that server, the scripts (test database, slots) this cluster"
  fi
  local db
  db="$(test_database_name)"
  if ! pg psql -X -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'" | grep -q 1; then
    pg psql -X -d postgres -qc "CREATE DATABASE \"$db\""
  fi
}

stop_postgres() {
  local bin
  bin="$(pg_bin)" || return 0
  [ -s "$PG_DATA/PG_VERSION" ] && pg_running "$bin" || return 0
  pg_server_cmd "$bin/pg_ctl" -D "$PG_DATA" -w -t 60 -m fast stop >/dev/null
}

pg_export_url
