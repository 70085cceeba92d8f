# HAProxy 2.6 from Debian's packages, as compose.replicated.yaml uses haproxy:2.6 (its config at
# /usr/local/etc/haproxy/haproxy.cfg): for hosts that reach Debian's mirror but no image registry.
ARG BASE_IMAGE=localhost/pfl-edge-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /usr/local/etc/haproxy
EXPOSE 8080 8081
CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
