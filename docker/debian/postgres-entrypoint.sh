#!/bin/sh
# The Debian-made PostgreSQL image's entrypoint: the subset of the official image's that compose.yaml uses. At the
# first start (an empty $PGDATA) create the cluster with POSTGRES_USER as its superuser (password
# POSTGRES_PASSWORD, scram-sha-256 over TCP from anywhere, trust only on the local socket) and the database
# POSTGRES_DB; then run the server in the foreground, listening on every address.
set -eu
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    initdb --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
        --encoding=UTF8 -D "$PGDATA" >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    if [ "$db" != postgres ]; then
        pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
        createdb --username="$user" "$db"
        pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    fi
    echo "postgres-entrypoint: created the cluster with role $user and database $db"
fi
exec "$@" -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/run/postgresql
