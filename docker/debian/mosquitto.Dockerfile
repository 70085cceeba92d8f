# Mosquitto 2.0 from Debian's packages, laid out as compose.yaml expects of eclipse-mosquitto:2.0 (its config at
# /mosquitto/config, data at /mosquitto/data, the dynamic-security plugin at /usr/lib, mosquitto_ctrl and
# mosquitto_sub on PATH): for hosts that reach Debian's mirror but no image registry. docker/debian/images.sh.
ARG BASE_IMAGE=localhost/pfl-edge-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends mosquitto mosquitto-clients \
    && rm -rf /var/lib/apt/lists/* \
    && ln -s "$(find /usr/lib -name mosquitto_dynamic_security.so | head -n 1)" /usr/lib/mosquitto_dynamic_security.so \
    && test -e /usr/lib/mosquitto_dynamic_security.so \
    && mkdir -p /mosquitto/config /mosquitto/data /mosquitto/log \
    && chown -R mosquitto:mosquitto /mosquitto
VOLUME /mosquitto/data
EXPOSE 1883
# as the eclipse image: started as root, Mosquitto drops to its own user ("mosquitto") once the port is bound
CMD ["mosquitto", "-c", "/mosquitto/config/mosquitto.conf"]
