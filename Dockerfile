# The pfl-edge server in a container (the CPU build of torch: the server averages and checks weights, no GPU).
# With its broker (Mosquitto) and database (PostgreSQL): compose.yaml and docs/operations.md, "Containers".
#   docker build -t pfl-edge-server .
# The server's embedded MQTT broker listens on loopback only: in a container, give it an external broker
# (PFL_BROKER_URL, and PFL_PUBLIC_BROKER_URL as devices reach it), as compose.yaml does.
FROM python:3.11-slim

# a fixed, unprivileged user: /data (the SQLite file if any, the blobs, the broker port file) and /shared (the
# blobs and programs replicas share: compose.replicated.yaml) belong to it, and
# a volume mounted there takes that ownership on first use
ARG PFL_UID=10001
RUN groupadd --gid "${PFL_UID}" pfl \
    && useradd --uid "${PFL_UID}" --gid pfl --no-create-home --home-dir /data --shell /usr/sbin/nologin pfl \
    && mkdir -p /data /shared && chown pfl:pfl /data /shared && chmod 0700 /data /shared

WORKDIR /app
# torch first, from the CPU index (the PyPI default would pull the CUDA build, ~4 GB more); the project's own
# install then finds torch==2.13.0 satisfied
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY pfl_edge pfl_edge
COPY device_profiles device_profiles
COPY export export
COPY edge_runtime edge_runtime
COPY server server
RUN pip install --no-cache-dir . && rm -rf /app/build
COPY docker/healthcheck.py /usr/local/bin/pfl-healthcheck

ENV PFL_DATA_DIR=/data PYTHONUNBUFFERED=1
VOLUME /data
USER pfl
EXPOSE 8080
# /healthz with the database and the MQTT link up (docker/healthcheck.py; HEALTHCHECK_URL for another port)
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "/usr/local/bin/pfl-healthcheck"]
ENTRYPOINT ["pfl-edge"]
CMD ["server", "--host", "0.0.0.0", "--port", "8080"]
