#!/usr/bin/env bash
# Self-signed CA and a SuperLink certificate for a tafl federation (TLS on the SuperLink's APIs).
# Usage: deploy/flower/make_certs.sh OUT_DIR [SUPERLINK_HOSTNAME] [SUPERLINK_IP]
# Production sites use their PKI instead; the SuperNodes only need ca.crt.
set -euo pipefail
out=${1:?usage: make_certs.sh OUT_DIR [HOSTNAME] [IP]}
host=${2:-localhost}
ip=${3:-127.0.0.1}
mkdir -p "$out"
cd "$out"
openssl genrsa -out ca.key 4096 2>/dev/null
openssl req -new -x509 -key ca.key -sha256 -days 365 -subj "/O=tafl federation/CN=tafl CA" -out ca.crt
openssl genrsa -out server.key 4096 2>/dev/null
openssl req -new -key server.key -subj "/O=tafl federation/CN=$host" -out server.csr
printf "subjectAltName=DNS:%s,IP:%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n" \
  "$host" "$ip" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.pem -days 365 -sha256 \
  -extfile server.ext 2>/dev/null
rm -f server.csr server.ext ca.srl
echo "wrote $out/ca.crt (give to every SuperNode), $out/server.pem and $out/server.key (SuperLink only)"
