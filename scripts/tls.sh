#!/usr/bin/env bash
# Certificates for the TLS tests and the demo, made with openssl on this machine and never
# committed: a certificate authority of this checkout, a server certificate for 127.0.0.1 and
# localhost (the test broker's TLS listeners and the test PostgreSQL cluster), a client
# certificate whose key is encrypted with a password (mTLS), and a second, untrusted authority
# with a server certificate of its own (the "untrusted certificate" tests).
# Sourced by scripts/services.sh; `ensure_tls` makes what is missing and prints nothing else.
#
# Files in .services/tls/:
#   ca.pem                      the authority's certificate (trust this one)
#   server.pem, server.key      server certificate and key (PKCS#8, not encrypted)
#   server-keystore.pem         key and chain in one file (Kafka's PEM keystore)
#   client.pem, client.key      client certificate and key (PKCS#8, encrypted)
#   client.key.password         the client key's password (mode 600)
#   rogue-ca.pem, rogue-server.pem, rogue-server.key, rogue-server-keystore.pem
set -euo pipefail

# Always this checkout's: a directory named by the environment is never made or removed.
TLS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.services/tls"
# Days the certificates are valid; remade when fewer than TLS_RENEW_DAYS remain.
TLS_DAYS=825
TLS_RENEW_DAYS=30

tls_log() { printf '[tls] %s\n' "$*" >&2; }

# tls_authority NAME: a self-signed authority NAME.pem / NAME.key (in $TLS_DIR, which
# ensure_tls points at a fresh directory while it makes them).
tls_authority() {
  openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days "$TLS_DAYS" \
    -subj "/CN=outbox test authority ($1)" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    -keyout "$TLS_DIR/$1.key" -out "$TLS_DIR/$1.pem" 2>"$TLS_DIR/openssl.log" \
    || { cat "$TLS_DIR/openssl.log" >&2; return 1; }
}

# tls_leaf NAME CA USAGE [KEY_PASSWORD_FILE]: NAME.pem signed by CA, for 127.0.0.1 and
# localhost; USAGE is serverAuth or clientAuth. With a password file, the key is encrypted.
tls_leaf() {
  local name="$1" ca="$2" usage="$3" password_file="${4:-}" ext
  ext="$(mktemp)"
  printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=$usage" "subjectAltName=DNS:localhost,IP:127.0.0.1" >"$ext"
  openssl req -newkey rsa:2048 -nodes -subj "/CN=outbox-$name" \
    -keyout "$TLS_DIR/$name.key.plain" -out "$TLS_DIR/$name.csr" 2>/dev/null
  openssl x509 -req -sha256 -days "$TLS_DAYS" -in "$TLS_DIR/$name.csr" \
    -CA "$TLS_DIR/$ca.pem" -CAkey "$TLS_DIR/$ca.key" -CAcreateserial \
    -extfile "$ext" -out "$TLS_DIR/$name.pem" 2>/dev/null
  if [ -n "$password_file" ]; then
    openssl pkcs8 -topk8 -v2 aes-256-cbc -in "$TLS_DIR/$name.key.plain" \
      -passout "file:$password_file" -out "$TLS_DIR/$name.key"
  else
    openssl pkcs8 -topk8 -nocrypt -in "$TLS_DIR/$name.key.plain" -out "$TLS_DIR/$name.key"
  fi
  rm -f "$TLS_DIR/$name.key.plain" "$TLS_DIR/$name.csr" "$ext"
  cat "$TLS_DIR/$name.key" "$TLS_DIR/$name.pem" "$TLS_DIR/$ca.pem" >"$TLS_DIR/$name-keystore.pem"
  chmod 600 "$TLS_DIR/$name.key" "$TLS_DIR/$name-keystore.pem"
}

tls_fresh() {
  local f
  for f in ca.pem server.pem server.key server-keystore.pem client.pem client.key \
    client.key.password rogue-ca.pem rogue-server-keystore.pem; do
    [ -s "$TLS_DIR/$f" ] || return 1
  done
  openssl x509 -checkend $((TLS_RENEW_DAYS * 86400)) -noout -in "$TLS_DIR/ca.pem" >/dev/null
}

ensure_tls() {
  command -v openssl >/dev/null 2>&1 || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >/dev/null
  }
  if tls_fresh; then return 0; fi
  local final="$TLS_DIR" parent
  parent="$(dirname "$final")"
  mkdir -p "$parent"
  # One maker at a time (the demo and the tests may start together); made in a directory of
  # its own and moved into place whole, so an interrupted run leaves no half set.
  exec {tls_lock}>"$parent/tls.lock"
  flock "$tls_lock"
  if tls_fresh; then exec {tls_lock}>&-; return 0; fi
  tls_log "making a test certificate authority and certificates in $final"
  TLS_DIR="$(mktemp -d "$parent/tls.new.XXXXXX")"
  (
    set -e
    chmod 700 "$TLS_DIR"
    (umask 077 && openssl rand -hex 16 >"$TLS_DIR/client.key.password")
    tls_authority ca
    tls_authority rogue-ca
    tls_leaf server ca serverAuth
    tls_leaf client ca clientAuth "$TLS_DIR/client.key.password"
    tls_leaf rogue-server rogue-ca serverAuth
    # Services may run as another user (PostgreSQL as postgres): the directory is readable,
    # the keys are copied where each service needs them, with their owner's permissions.
    chmod 755 "$TLS_DIR"
  ) || { local made="$TLS_DIR"; TLS_DIR="$final"; rm -rf "$made"; exec {tls_lock}>&-; return 1; }
  if [ -d "$final" ]; then mv "$final" "$parent/tls.old.$$"; fi
  mv "$TLS_DIR" "$final"
  rm -rf "$parent/tls.old.$$"
  TLS_DIR="$final"
  exec {tls_lock}>&-
}
