# The pfl-edge server in a container (the CPU build of torch: the server averages and checks weights, no GPU).
#   docker build -t pfl-edge-server .
#   docker run -p 8080:8080 -e PFL_ADMIN_TOKEN=change-me -e PFL_BROKER_URL=mqtt://broker:1883 -v pfl-data:/data pfl-edge-server
# With an external broker and PostgreSQL:
#   docker run -p 8080:8080 -e PFL_ADMIN_TOKEN=... -e PFL_BROKER_URL=mqtt://mosquitto:1883 \
#     -e PFL_DATABASE_URL=postgresql://pfl@db/pfl -e PFL_PUBLIC_URL=http://server.example:8080 pfl-edge-server
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY pfl_edge pfl_edge
COPY device_profiles device_profiles
COPY export export
COPY edge_runtime edge_runtime
COPY server server
RUN pip install --no-cache-dir .
ENV PFL_DATA_DIR=/data
VOLUME /data
EXPOSE 8080
# the embedded broker listens on loopback; in a container, point devices at an external broker
# (PFL_BROKER_URL / PFL_PUBLIC_BROKER_URL) or publish the server's host network
CMD ["pfl-edge", "server", "--host", "0.0.0.0", "--port", "8080"]
