#!/bin/sh
# The Mosquitto container's command (compose.yaml): at the first start, create the dynamic-security plugin's file
# with one admin client, the pfl-edge server's identity (PFL_MQTT_USERNAME / PFL_MQTT_PASSWORD), whose role may
# also publish the federations' topics pfl/# (what server.broker_setup.init_dynsec does where Python runs); then
# run Mosquitto. Later starts keep the file: it holds every device the server has provisioned since.
# POSIX sh (the eclipse-mosquitto image is Alpine/busybox). MOSQUITTO_CONF names another config (tests).
set -eu
conf="${MOSQUITTO_CONF:-/mosquitto/config/mosquitto.conf}"
dynsec="$(sed -n 's/^plugin_opt_config_file[[:space:]]\{1,\}//p' "$conf" | tail -n 1)"
if [ -z "$dynsec" ]; then
    echo "mosquitto-entrypoint: $conf names no plugin_opt_config_file" >&2
    exit 1
fi
if [ ! -s "$dynsec" ]; then
    : "${PFL_MQTT_USERNAME:?set PFL_MQTT_USERNAME (the server's MQTT admin name)}"
    : "${PFL_MQTT_PASSWORD:?set PFL_MQTT_PASSWORD (the server's MQTT admin password)}"
    umask 077
    tmp="$dynsec.new"
    rm -f "$tmp"
    printf '%s\n%s\n' "$PFL_MQTT_PASSWORD" "$PFL_MQTT_PASSWORD" \
        | mosquitto_ctrl dynsec init "$tmp" "$PFL_MQTT_USERNAME" >/dev/null
    # the init's only "acls" array is the admin role's: put pfl/# (publish) first in it
    sed -i 's|"acls":[[:space:]]*\[{|"acls": [{"acltype": "publishClientSend", "topic": "pfl/#", "allow": true}, {|' "$tmp"
    if ! grep -q '"pfl/#"' "$tmp"; then
        echo "mosquitto-entrypoint: could not add pfl/# to the admin role of $tmp" >&2
        exit 1
    fi
    mv "$tmp" "$dynsec"
    # the image's entrypoint runs this as root and Mosquitto then drops to its own user, which must write the file
    if [ "$(id -u)" = 0 ] && id mosquitto >/dev/null 2>&1; then
        chown mosquitto:mosquitto "$dynsec"
    fi
    echo "mosquitto-entrypoint: created $dynsec with admin client $PFL_MQTT_USERNAME"
fi
exec mosquitto -c "$conf"
