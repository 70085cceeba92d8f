#!/bin/sh
# The RabbitMQ container's command (compose.replicated.yaml): write the MQTT plugin's settings and the HTTP auth
# hook's URLs, which carry the hook's token (PFL_BROKER_HOOK_TOKEN, a secret: never in a committed file), into
# a conf.d file, then run the image's own entrypoint with the arguments (docker-entrypoint.sh rabbitmq-server).
# The lines are server.rabbitmq.rabbitmq_conf's for hook_url = http://haproxy:8081/v1/broker/hook/<token>
# (tests/test_container.py holds them to it): HAProxy's hook listener, on the compose network only; the devices'
# port (8080) refuses the hook's paths. PFL_RABBITMQ_CONF names another file (tests).
set -eu
: "${PFL_BROKER_HOOK_TOKEN:?set PFL_BROKER_HOOK_TOKEN (the secret in the server hook's URL)}"
conf="${PFL_RABBITMQ_CONF:-/etc/rabbitmq/conf.d/20-pfl.conf}"
hook="http://haproxy:8081/v1/broker/hook/$PFL_BROKER_HOOK_TOKEN"
umask 077
cat > "$conf" <<EOC
mqtt.listeners.tcp.default = 1883
mqtt.allow_anonymous = false
mqtt.vhost = /
auth_backends.1 = http
auth_http.http_method = post
auth_http.user_path = $hook/user
auth_http.vhost_path = $hook/vhost
auth_http.resource_path = $hook/resource
auth_http.topic_path = $hook/topic
EOC
if [ "$(id -u)" = 0 ] && id rabbitmq >/dev/null 2>&1; then
    chown rabbitmq:rabbitmq "$conf"
fi
exec "$@"
