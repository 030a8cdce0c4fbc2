#!/usr/bin/env bash
# Makes the TLS material and passwords for k8s/etcd and its clients, with openssl only (no cluster access):
#   ca.crt ca.key          the CA that etcd members and clients trust
#   server.crt server.key  one certificate for every member, as server and as peer (hence both key usages)
#   client.crt client.key  elasticd's and the enable-auth Job's client certificate (etcd requires one: --client-cert-auth)
#   root-password elasticd-password   etcd user passwords, without a trailing newline
# Usage: k8s/etcd/make-certs.sh [DIR (default ./etcd-certs)] [NAMESPACE (default elasticd)]
# The names in server.crt follow the StatefulSet (etcd-N.etcd-peer.NAMESPACE.svc): change them together.
set -euo pipefail

dir=${1:-etcd-certs}
namespace=${2:-elasticd}
days=${ETCD_CERT_DAYS:-825} # about 27 months; rotate (rerun, recreate the Secrets, restart) before then

mkdir -p "$dir"
cd "$dir"
umask 077 # keys and passwords readable by their owner only

new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# A self-signed CA, with its extensions spelled out so that no distribution's openssl.cnf changes them.
cat >ca.cnf <<CNF
[req]
distinguished_name = dn
prompt = no
x509_extensions = ca
[dn]
CN = elasticd-etcd-ca
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
CNF
new_key ca.key
openssl req -x509 -new -key ca.key -config ca.cnf -days "$days" -out ca.crt

sign() { # sign NAME CN EXTENDED_KEY_USAGE [SUBJECT_ALT_NAMES]
    local name=$1 cn=$2 usage=$3 san=${4:-}
    new_key "$name.key"
    openssl req -new -key "$name.key" -subj "/CN=$cn" -out "$name.csr"
    {
        echo "basicConstraints = critical, CA:FALSE"
        echo "keyUsage = critical, digitalSignature"
        echo "extendedKeyUsage = $usage"
        echo "authorityKeyIdentifier = keyid"
        if [[ -n $san ]]; then echo "subjectAltName = $san"; fi
    } >"$name.ext"
    openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" \
        -extfile "$name.ext" -out "$name.crt" 2>/dev/null
    rm -f "$name.csr" "$name.ext"
}

peers="etcd-peer.$namespace.svc"
sign server etcd "serverAuth, clientAuth" \
    "DNS:*.$peers, DNS:*.$peers.cluster.local, DNS:etcd.$namespace.svc, DNS:etcd.$namespace.svc.cluster.local, DNS:localhost, IP:127.0.0.1"
# With --client-cert-auth and auth enabled, etcd takes a client certificate's CN as the user name when no
# password is given: this certificate can only ever act as the (least-privileged) elasticd user.
sign client elasticd "clientAuth"

for user in root elasticd; do
    printf '%s' "$(openssl rand -hex 24)" >"$user-password"
done
rm -f ca.cnf ca.srl

echo "etcd TLS material and passwords are in $PWD. Next (docs/deploy-kubernetes.md):"
cat <<NEXT
  kubectl -n $namespace create secret generic etcd-server-tls \\
    --from-file=ca.crt --from-file=tls.crt=server.crt --from-file=tls.key=server.key
  kubectl -n $namespace create secret generic etcd-root --from-file=password=root-password
  kubectl -n $namespace create secret generic elasticd-etcd --from-file=ca.crt \\
    --from-file=tls.crt=client.crt --from-file=tls.key=client.key --from-file=password=elasticd-password
NEXT
