#!/usr/bin/env bash
# A throw-away CA and a server certificate it signed, for the kind suite's TLS phase
# (tests/e2e/phases/tls.sh): EC P-256 keys, valid 2 days, the server's names as DNS SANs.
#
#   bash tests/e2e/lib/tls_certs.sh OUT_DIR HOST [HOST...]
#
# Writes OUT_DIR/ca.crt (what clients trust), OUT_DIR/tls.crt and OUT_DIR/tls.key (the
# kubernetes.io/tls Secret's pair). The extensions are spelled out (no openssl.cnf defaults):
# a CA with keyCertSign, a leaf for serverAuth with subject and authority key ids, which strict
# verifiers (Python 3.13's VERIFY_X509_STRICT) require.
set -euo pipefail
[[ $# -ge 2 ]] || { echo "usage: $0 OUT_DIR HOST [HOST...]" >&2; exit 2; }
out="$1"; shift
mkdir -p "$out"
sans=""
for h in "$@"; do sans="${sans:+$sans, }DNS:$h"; done
cat > "$out/openssl.cnf" <<CNF
[req]
distinguished_name = dn
prompt = no
[dn]
CN = trainergroup e2e CA
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = $sans
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
CNF
ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
openssl req -x509 -config "$out/openssl.cnf" -extensions ca "${ec[@]}" -days 2 \
  -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null
openssl req -new -config "$out/openssl.cnf" -subj "/CN=$1" "${ec[@]}" \
  -keyout "$out/tls.key" -out "$out/tls.csr" 2>/dev/null
openssl x509 -req -in "$out/tls.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
  -set_serial "0x$(openssl rand -hex 8)" -days 2 -extfile "$out/openssl.cnf" -extensions server \
  -out "$out/tls.crt" 2>/dev/null
rm -f "$out/tls.csr" "$out/ca.key"   # nothing signs with the CA again
chmod 0600 "$out/tls.key"
