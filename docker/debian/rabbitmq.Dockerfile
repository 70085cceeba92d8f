# RabbitMQ 3.10 from Debian's packages (its MQTT and HTTP-auth plugins ship with it), as compose.replicated.yaml
# uses rabbitmq:3.10: the command names docker-entrypoint.sh, which here only runs its arguments (the official
# image's also writes defaults this set-up does not use), settings from /etc/rabbitmq/conf.d, plugins from
# RABBITMQ_ENABLED_PLUGINS_FILE. For hosts that reach Debian's mirror but no image registry.
ARG BASE_IMAGE=localhost/pfl-edge-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends rabbitmq-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /etc/rabbitmq/conf.d /var/lib/rabbitmq \
    && chown -R rabbitmq:rabbitmq /etc/rabbitmq /var/lib/rabbitmq \
    && printf '#!/bin/sh\nexec "$@"\n' > /usr/local/bin/docker-entrypoint.sh \
    && chmod 0755 /usr/local/bin/docker-entrypoint.sh
VOLUME /var/lib/rabbitmq
EXPOSE 1883 5672
CMD ["docker-entrypoint.sh", "rabbitmq-server"]
