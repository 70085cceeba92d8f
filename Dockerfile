# The pfl-edge server in a container (the CPU build of torch: the server averages and checks weights, no GPU).
# With its broker (Mosquitto) and database (PostgreSQL): compose.yaml and docs/operations.md, "Containers".
#   docker build -t pfl-edge-server .
#   podman build --format docker -t pfl-edge-server .      (podman's default OCI format drops the HEALTHCHECK)
# Where no registry is reachable, build the base from Debian's packages and pass it (docs/operations.md):
#   docker/debian/images.sh        (makes localhost/pfl-edge-base:bookworm and builds every image on it)
# The server's embedded MQTT broker listens on loopback only: in a container, give it an external broker
# (PFL_BROKER_URL, and PFL_PUBLIC_BROKER_URL as devices reach it), as compose.yaml does.

# any image with Python 3.11 (python3 and its venv module): the official one, or Debian's bookworm
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS deps
# torch first, from the CPU index (the PyPI default would pull the CUDA build, ~4 GB more); the project's own
# install then finds torch==2.13.0 satisfied. TORCH may instead name a wheel file inside the build (podman build
# -v /dir/of/wheels:/wheels:ro --build-arg TORCH=/wheels/torch-...whl)
ARG TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# a CA bundle for pip behind a TLS-intercepting proxy (mounted into the build; unset: pip's own)
ARG PIP_CERT
RUN python3 -m venv /opt/pfl
ENV PATH=/opt/pfl/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install ${TORCH}
# The dependencies alone, in a stage that only changes with pyproject.toml (a code change rebuilds one small
# layer): the project's metadata without its packages installs exactly its dependency list.
# Then what neither the server nor its export worker imports (python -m export.worker, a child of the server in
# this image, needs torch, onnx, onnxscript, onnxruntime and executorch): ExecuTorch's optional Core ML backend
# and devtools' tables (coremltools, pandas, scikit-learn), and the plots (matplotlib; pillow stays, 15 MB: a
# device's own images). scipy stays: the privacy accountant (Opacus's RDP analysis) of a private federation
# needs it. docs/operations.md "Containers" gives the sizes.
COPY pyproject.toml README.md /src/
RUN pip install /src && pip uninstall -y pfl-edge \
    && pip uninstall -y coremltools pandas scikit-learn matplotlib contourpy fonttools kiwisolver cycler

FROM ${BASE_IMAGE}
# a fixed, unprivileged user: /data (the SQLite file if any, the blobs, the broker port file) and /shared (the
# blobs and programs replicas share: compose.replicated.yaml) belong to it, and
# a volume mounted there takes that ownership on first use
ARG PFL_UID=10001
RUN groupadd --gid "${PFL_UID}" pfl \
    && useradd --uid "${PFL_UID}" --gid pfl --no-create-home --home-dir /data --shell /usr/sbin/nologin pfl \
    && mkdir -p /data /shared && chown pfl:pfl /data /shared && chmod 0700 /data /shared
COPY --from=deps /opt/pfl /opt/pfl
ENV PATH=/opt/pfl/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md /src/
COPY pfl_edge /src/pfl_edge
COPY device_profiles /src/device_profiles
COPY export /src/export
COPY edge_runtime /src/edge_runtime
COPY server /src/server
# offline: the build backend (setuptools, which torch needs anyway) is in the venv
RUN pip install --no-deps --no-build-isolation /src && rm -rf /src
COPY docker/healthcheck.py /usr/local/bin/pfl-healthcheck

ENV PFL_DATA_DIR=/data PYTHONUNBUFFERED=1
WORKDIR /data
VOLUME /data
USER pfl
EXPOSE 8080
# /healthz with the database and the MQTT link up (docker/healthcheck.py; HEALTHCHECK_URL for another port)
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "/usr/local/bin/pfl-healthcheck"]
ENTRYPOINT ["pfl-edge"]
CMD ["server", "--host", "0.0.0.0", "--port", "8080"]
