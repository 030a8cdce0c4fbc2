#!/usr/bin/env bash
# Turns on etcd's authentication for elasticd, once; safe to run again (it checks before each step).
#   root      etcd's administrator (password in $ROOT_PASSWORD_FILE), needed to enable auth and for later admin
#   elasticd  a user whose role reads and writes the /elasticd/ prefix only: every key of every run lives there
# Reads etcdctl's own ETCDCTL_ENDPOINTS, ETCDCTL_CACERT, ETCDCTL_CERT and ETCDCTL_KEY. Passwords go to etcdctl on
# stdin or in its environment, never on a command line (visible to every process on the host).
set -euo pipefail

: "${ROOT_PASSWORD_FILE:?}" "${USER_PASSWORD_FILE:?}" "${ETCDCTL_ENDPOINTS:?}"
prefix=${KEY_PREFIX:-/elasticd/} # elasticd/keys.py ROOT, with the trailing slash: /elasticd-x is not ours

# Without credentials, auth status answers only while auth is off; once it is on, only root may ask.
status=$(etcdctl auth status 2>/dev/null || ETCDCTL_USER=root ETCDCTL_PASSWORD=$(<"$ROOT_PASSWORD_FILE") etcdctl auth status)
if [[ $status == *'Authentication Status: true'* ]]; then
    echo "etcd authentication is already enabled: nothing to do"
    exit 0
fi

add_user() { # add_user NAME PASSWORD_FILE: a user that does not exist yet gets the password from the file
    if etcdctl user get "$1" >/dev/null 2>&1; then
        echo "user $1 exists"
    else
        etcdctl user add "$1" --interactive=false <"$2"
    fi
}

add_user root "$ROOT_PASSWORD_FILE"
etcdctl user grant-role root root # auth enable refuses a root user without the root role
etcdctl role get elasticd >/dev/null 2>&1 || etcdctl role add elasticd
etcdctl role grant-permission elasticd --prefix=true readwrite "$prefix"
add_user elasticd "$USER_PASSWORD_FILE"
etcdctl user grant-role elasticd elasticd
etcdctl auth enable
echo "etcd authentication enabled: users root and elasticd (readwrite ${prefix})"
