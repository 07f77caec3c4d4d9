#!/usr/bin/env bash
# Starts what the tests and the demo need on this machine: a PostgreSQL cluster of this
# checkout's own (scripts/postgres.sh: Debian's binaries, its data in .services/postgres, port
# 54329, TLS and passwords; no other cluster is touched) and Apache Kafka in KRaft mode, plus
# Kafka Connect with Debezium's Postgres connector for the tests that need it. Installs what
# is missing: PostgreSQL with apt, the Kafka and Debezium jars from Maven Central through the
# poms in services/ (resolved once into ~/.m2, checksums enforced).
# Sourced by scripts/test, scripts/demo, scripts/bench and scripts/chaos; safe to run again
# (it skips what is already up).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SERVICES_DIR="$ROOT/.services"
KAFKA_PORT="${KAFKA_PORT:-9092}"
CONNECT_PORT="${CONNECT_PORT:-8083}"
export OUTBOX_TEST_KAFKA="${OUTBOX_TEST_KAFKA:-127.0.0.1:$KAFKA_PORT}"
export OUTBOX_TEST_CONNECT="${OUTBOX_TEST_CONNECT:-http://127.0.0.1:$CONNECT_PORT}"
export OUTBOX_TEST_KAFKA_CLASSPATH_FILE="$SERVICES_DIR/kafka.classpath"
# The test broker's secured listeners (scripts/kafka-node), the certificates they serve
# (scripts/tls.sh) and the SCRAM user the scripts create on it.
export OUTBOX_TEST_KAFKA_SASL_SSL="${OUTBOX_TEST_KAFKA_SASL_SSL:-127.0.0.1:$((KAFKA_PORT + 2))}"
export OUTBOX_TEST_KAFKA_MTLS="${OUTBOX_TEST_KAFKA_MTLS:-127.0.0.1:$((KAFKA_PORT + 3))}"
export OUTBOX_TEST_TLS_DIR="${OUTBOX_TEST_TLS_DIR:-$SERVICES_DIR/tls}"
export OUTBOX_TEST_KAFKA_SCRAM_USER="${OUTBOX_TEST_KAFKA_SCRAM_USER:-outbox}"
export OUTBOX_TEST_KAFKA_SCRAM_PASSWORD_FILE="${OUTBOX_TEST_KAFKA_SCRAM_PASSWORD_FILE:-$SERVICES_DIR/kafka/scram.password}"
export PATH="$HOME/.cargo/bin:$PATH"
mkdir -p "$SERVICES_DIR"
# PostgreSQL: the checkout's own cluster (ensure_postgres, pg, test_database_name); it sets
# OUTBOX_TEST_DATABASE_URL unless the caller did.
source "$ROOT/scripts/postgres.sh"

log() { printf '[services] %s\n' "$*" >&2; }

# What building the workspace needs besides Rust: librdkafka is compiled with OpenSSL (TLS,
# SCRAM, OAUTHBEARER) and Cyrus SASL (GSSAPI), found through pkg-config; cmake and a C++
# compiler for librdkafka itself.
BUILD_PACKAGES=(pkg-config libssl-dev libsasl2-dev libsasl2-modules-gssapi-mit cmake g++ make)
ensure_build_deps() {
  local missing=() p
  for p in "${BUILD_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  log "installing the build's system packages: ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

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

# resolve_jars NAME: resolves services/NAME/pom.xml and writes the jars' classpath to
# .services/NAME.classpath. A classpath newer than its pom whose jars all exist is reused, so
# a second run resolves nothing and needs no network.
resolve_jars() {
  local name="$1" pom="$ROOT/services/$1/pom.xml" out="$SERVICES_DIR/$1.classpath"
  if [ -s "$out" ] && [ "$out" -nt "$pom" ] && jars_present "$out"; then return 0; fi
  if ! command -v mvn >/dev/null 2>&1 || ! command -v java >/dev/null 2>&1 || ! command -v javac >/dev/null 2>&1; then
    log "installing OpenJDK 17 (with javac: the tests run Java source files) and Maven from Debian's packages"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jdk-headless maven >/dev/null
  fi
  log "resolving the $name jars from Maven Central ($pom)"
  # Maven's output only when it fails: even with -B -q and style.color=never, Maven 3.9 writes
  # bare ANSI resets (ESC[0m) to a pipe, which would land in the demo's first lines.
  local mvn_log
  mvn_log="$(mktemp)"
  if ! mvn -B -q --strict-checksums -Dstyle.color=never -f "$pom" dependency:build-classpath \
      -Dmdep.outputFile="$out.tmp" >"$mvn_log" 2>&1; then
    sed 's/\x1b\[[0-9;]*m//g' "$mvn_log" >&2
    rm -f "$mvn_log"
    return 1
  fi
  rm -f "$mvn_log"
  mv "$out.tmp" "$out"
}

jars_present() {
  local jar
  for jar in $(tr ':' ' ' <"$1"); do [ -f "$jar" ] || return 1; done
}

source "$ROOT/scripts/tls.sh"

new_cluster_id() { python3 -c 'import base64, uuid; print(base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("="))'; }

# start_kafka_node DIR NODE_ID PORT CONTROLLER_PORT VOTERS CLUSTER_ID REPLICATION: one node
# in the background, its log in DIR/broker.log, its pid in DIR/pid.
start_kafka_node() {
  local dir="$1"
  mkdir -p "$dir"
  nohup "$ROOT/scripts/kafka-node" "$@" >>"$dir/broker.log" 2>&1 &
  echo $! >"$dir/pid"
}

# The single broker the tests, the demo and the benchmarks use: 127.0.0.1:$KAFKA_PORT, its
# data in .services/kafka (kept across runs; delete the directory for an empty broker). It
# also serves SASL_SSL on $KAFKA_PORT+2 and mTLS on $KAFKA_PORT+3 (scripts/kafka-node), with
# a SCRAM-SHA-512 user whose password is in $OUTBOX_TEST_KAFKA_SCRAM_PASSWORD_FILE.
start_kafka() {
  if [ "$OUTBOX_TEST_KAFKA" != "127.0.0.1:$KAFKA_PORT" ]; then
    log "using the broker at $OUTBOX_TEST_KAFKA (OUTBOX_TEST_KAFKA); starting none"
    return 0
  fi
  resolve_jars kafka
  ensure_tls
  local dir="$SERVICES_DIR/kafka" controller_port=$((KAFKA_PORT + 1)) certificates
  certificates="$(cat "$TLS_DIR/server-keystore.pem" "$TLS_DIR/ca.pem" | sha256sum | cut -c1-64)"
  if port_open "$KAFKA_PORT"; then
    local why=""
    if ! port_open $((KAFKA_PORT + 3)); then
      why="to add its TLS listeners"
    elif [ "$(cat "$dir/certificates.sha256" 2>/dev/null)" != "$certificates" ]; then
      why="to serve the certificates scripts/tls.sh made again"
    fi
    if [ -n "$why" ]; then
      local old
      old="$(cat "$dir/pid" 2>/dev/null || true)"
      # Only the broker these scripts started: its java process runs this checkout's
      # server.properties. Another broker on the port is left alone.
      if [ -z "$old" ] || ! tr '\0' ' ' <"/proc/$old/cmdline" 2>/dev/null \
        | grep -q "kafka.Kafka $dir/server.properties"; then
        log "a broker these scripts did not start holds 127.0.0.1:$KAFKA_PORT (set OUTBOX_TEST_KAFKA to use it, or stop it)"
        return 1
      fi
      log "restarting the test broker $why"
      kill "$old" 2>/dev/null || true
      wait_for "the test broker to stop" 120 pid_gone "$old"
    fi
  fi
  if ! port_open "$KAFKA_PORT"; then
    mkdir -p "$dir"
    [ -s "$dir/cluster.id" ] || new_cluster_id >"$dir/cluster.id"
    log "starting Apache Kafka (KRaft) on 127.0.0.1:$KAFKA_PORT (SASL_SSL on $((KAFKA_PORT + 2)), mTLS on $((KAFKA_PORT + 3)))"
    start_kafka_node "$dir" 1 "$KAFKA_PORT" "$controller_port" \
      "1@127.0.0.1:$controller_port" "$(cat "$dir/cluster.id")" 1 "$TLS_DIR"
    echo "$certificates" >"$dir/certificates.sha256"
  fi
  wait_for "Kafka" 120 "$ROOT/scripts/kafka-ready" "127.0.0.1:$KAFKA_PORT" \
    || { tail -n 50 "$dir/broker.log" >&2; return 1; }
  ensure_scram_user
}

pid_gone() { ! kill -0 "$1" 2>/dev/null; }

# Creates (or updates) the SCRAM-SHA-512 user through Kafka's Admin API
# (services/kafka/ScramUser.java), through the plaintext listener; the password goes through a
# file, never a command line.
ensure_scram_user() {
  local password_file="$OUTBOX_TEST_KAFKA_SCRAM_PASSWORD_FILE"
  if [ ! -s "$password_file" ]; then
    (umask 077 && openssl rand -hex 16 >"$password_file")
  fi
  # An upsert, run at every start: a broker whose data was wiped gets its user back.
  java -Dlog4j2.configurationFile="$ROOT/services/kafka/log4j2.properties" \
    -cp "$(cat "$OUTBOX_TEST_KAFKA_CLASSPATH_FILE")" "$ROOT/services/kafka/ScramUser.java" \
    "127.0.0.1:$KAFKA_PORT" "$OUTBOX_TEST_KAFKA_SCRAM_USER" "$password_file" >/dev/null
}

# A 3-broker cluster (replication factor 3, min.insync.replicas=2) for the reliability
# campaign: brokers on 127.0.0.1:$1, $1+1, $1+2 (default 19092), controllers on $1+100...
# Data in .services/kafka-cluster/nodeN; prints the bootstrap list.
start_kafka_cluster() {
  local base="${1:-19092}" root="$SERVICES_DIR/kafka-cluster" voters="" n
  resolve_jars kafka
  mkdir -p "$root"
  [ -s "$root/cluster.id" ] || new_cluster_id >"$root/cluster.id"
  for n in 1 2 3; do voters="$voters${voters:+,}$n@127.0.0.1:$((base + 99 + n))"; done
  for n in 1 2 3; do
    if ! port_open $((base + n - 1)); then
      start_kafka_node "$root/node$n" "$n" $((base + n - 1)) $((base + 99 + n)) "$voters" \
        "$(cat "$root/cluster.id")" 3
    fi
  done
  wait_for "the 3-broker Kafka cluster" 120 "$ROOT/scripts/kafka-ready" "127.0.0.1:$base" 3
  echo "127.0.0.1:$base,127.0.0.1:$((base + 1)),127.0.0.1:$((base + 2))"
}

# Kafka Connect (standalone) with Debezium's Postgres connector on the classpath, REST API on
# 127.0.0.1:$CONNECT_PORT. Tests create and delete their own connectors through the API.
start_connect() {
  resolve_jars connect
  if curl -fsS "$OUTBOX_TEST_CONNECT/" >/dev/null 2>&1; then return 0; fi
  local dir="$SERVICES_DIR/connect"
  mkdir -p "$dir"
  cat >"$dir/worker.properties" <<PROPS
bootstrap.servers=$OUTBOX_TEST_KAFKA
listeners=http://127.0.0.1:$CONNECT_PORT
offset.storage.file.filename=$dir/offsets
offset.flush.interval.ms=1000
# Converters: connectors set their own (the tests state which they use); these are defaults.
key.converter=org.apache.kafka.connect.storage.StringConverter
value.converter=org.apache.kafka.connect.json.JsonConverter
value.converter.schemas.enable=false
header.converter=org.apache.kafka.connect.storage.SimpleHeaderConverter
PROPS
  log "starting Kafka Connect (standalone, Debezium $(debezium_version)) on 127.0.0.1:$CONNECT_PORT"
  nohup java ${CONNECT_HEAP_OPTS:--Xms256m -Xmx1g} -XX:+UseG1GC -Djava.awt.headless=true \
    "-Dlog4j2.configurationFile=$ROOT/services/kafka/log4j2.properties" \
    -cp "$(cat "$SERVICES_DIR/connect.classpath")" \
    org.apache.kafka.connect.cli.ConnectStandalone "$dir/worker.properties" \
    >>"$dir/connect.log" 2>&1 &
  echo $! >"$dir/pid"
  wait_for "Kafka Connect" 120 curl -fsS "$OUTBOX_TEST_CONNECT/connector-plugins" \
    || { tail -n 50 "$dir/connect.log" >&2; return 1; }
}

# Deletes every connector of the test worker (each test creates and deletes its own; an
# interrupted run leaves them streaming), waiting until their slots are released.
remove_test_connectors() {
  local name
  for name in $(curl -fsS "$OUTBOX_TEST_CONNECT/connectors" | python3 -c 'import json, sys; print(" ".join(json.load(sys.stdin)))'); do
    log "deleting connector $name left by an earlier run"
    curl -fsS -X DELETE "$OUTBOX_TEST_CONNECT/connectors/$name" >/dev/null
  done
  wait_for "replication slots to be released" 60 slots_idle
}

slots_idle() {
  [ "$(pg psql -X -d postgres -qAtc "SELECT count(*) FROM pg_replication_slots WHERE database = '$(test_database_name)' AND active")" = 0 ]
}

debezium_version() { grep -o '<debezium.version>[^<]*' "$ROOT/services/connect/pom.xml" | cut -d'>' -f2; }

ensure_services() {
  ensure_postgres
  start_kafka
}
