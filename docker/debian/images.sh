#!/bin/sh
# Build pfl-edge's images where no image registry is reachable, from Debian's packages alone: a bookworm base
# (mmdebstrap, then `import`), and on it the server (../../Dockerfile), Mosquitto, PostgreSQL, HAProxy and
# RabbitMQ (this folder). compose.yaml and compose.replicated.yaml then run them when told their names (the
# variables it prints at the end).
#
#   docker/debian/images.sh            as root (mmdebstrap and rootful podman); ENGINE=docker for docker
#
# The base is made once and kept (its tag names what it holds; PFL_REBUILD_BASE=1 makes it again); the other
# images reuse their cached layers, so a second run only rebuilds what changed.
#   PFL_TORCH_WHEEL  a torch 2.13.0 CPU wheel file on this host (podman only: mounted into the build); else
#                    torch comes from PyTorch's CPU index
#   PFL_PIP_CERT     a CA bundle for pip in the build (behind a TLS-intercepting proxy); else pip's own
#   PFL_IMAGE_TAG    the tag of the images (default: latest)
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
engine="${ENGINE:-podman}"
tag="${PFL_IMAGE_TAG:-latest}"
packages="python3,python3-venv,ca-certificates,passwd"
base="localhost/pfl-edge-base:bookworm-$(printf '%s' "$packages" | sha256sum | cut -c1-8)"
fmt=""
[ "$engine" = podman ] && fmt="--format docker"  # OCI, podman's default, has no HEALTHCHECK

step() { printf '%s images.sh: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

if [ "${PFL_REBUILD_BASE:-0}" = 1 ] || ! "$engine" image inspect "$base" >/dev/null 2>&1; then
    step "making $base with mmdebstrap"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    mmdebstrap --quiet --variant=minbase --include="$packages" \
        --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
        bookworm "$tmp/rootfs.tar"
    "$engine" import --change 'CMD ["/bin/sh"]' "$tmp/rootfs.tar" "$base" >/dev/null
fi

step "building localhost/pfl-edge-server:$tag"
set -- --build-arg "BASE_IMAGE=$base"
if [ -n "${PFL_TORCH_WHEEL:-}" ]; then
    set -- "$@" -v "$(dirname "$PFL_TORCH_WHEEL"):/wheels:ro" --build-arg "TORCH=/wheels/$(basename "$PFL_TORCH_WHEEL")"
fi
if [ -n "${PFL_PIP_CERT:-}" ]; then
    set -- "$@" -v "$PFL_PIP_CERT:/run/pip-ca.crt:ro" --build-arg PIP_CERT=/run/pip-ca.crt
fi
# shellcheck disable=SC2086
"$engine" build $fmt "$@" -t "localhost/pfl-edge-server:$tag" "$root" >&2

for svc in mosquitto postgres haproxy rabbitmq; do
    step "building localhost/pfl-edge-$svc:$tag"
    # shellcheck disable=SC2086
    "$engine" build $fmt --build-arg "BASE_IMAGE=$base" -f "$here/$svc.Dockerfile" \
        -t "localhost/pfl-edge-$svc:$tag" "$here" >&2
done

# what compose.yaml reads to run these instead of the registry's images
echo "PFL_SERVER_IMAGE=localhost/pfl-edge-server:$tag"
echo "PFL_MOSQUITTO_IMAGE=localhost/pfl-edge-mosquitto:$tag"
echo "PFL_POSTGRES_IMAGE=localhost/pfl-edge-postgres:$tag"
echo "PFL_HAPROXY_IMAGE=localhost/pfl-edge-haproxy:$tag"
echo "PFL_RABBITMQ_IMAGE=localhost/pfl-edge-rabbitmq:$tag"
