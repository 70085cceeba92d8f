"""The server's side of MQTT at start: the embedded broker (if ``broker_url`` is ``embedded``) on a stable
address, the address devices are told, the server's own identity and its link, all from the settings.

The embedded broker keeps its port across restarts (``<data_dir>/broker-port``, or ``embedded_broker_port``):
enrolled devices know it by that address. If that port is taken when the server starts, the server refuses to
start and says so, instead of silently moving the broker (and leaving the old address, and the passwords sent
to it, to whoever sits there). An operator who moves it on purpose sets ``embedded_broker_port``; devices that
cannot reach the old address ask ``GET /v1/devices/me/broker`` and follow (``edge_runtime.control``). The
server also refuses to hand devices a loopback broker address when they reach the server itself on another
address (``public_url``), naming the settings to set.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import ssl
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from pfl_edge.errors import ConfigError

from .broker import EmbeddedBroker, loopback
from .broker_core import Authenticator
from .broker_wire import Identity
from .mqtt import MqttLink, broker_tls, parse_broker_url
from .services.broker_access import Mode
from .services.broker_tokens import BrokerTokens
from .settings import Settings

__all__ = ["MqttSetup", "init_dynsec", "start_mqtt"]

log = logging.getLogger(__name__)

SERVER_USER = "pfl-server"  # the server's identity on its embedded broker (device ids start with "dev-")


@dataclass
class MqttSetup:
    broker: EmbeddedBroker | None  # the embedded broker, started; None: an external one
    url: str  # the broker as the server reaches it
    device_url: str  # the broker as devices reach it (told at enrolment)
    mode: Mode
    server_credentials: tuple[str, str]  # (username, password) of the server's link; ("", "") for none
    tls: ssl.SSLContext | None  # how the server's link verifies an mqtts:// broker
    tokens: BrokerTokens | None = None  # jwt mode: signs the devices' and the server's MQTT passwords

    def link(self, on_status: Callable[[str, bytes], None], on_reconnect: Callable[[], None]) -> MqttLink:
        user, password = self.server_credentials
        renew = None
        if self.tokens is not None:  # a fresh token of its own at every reconnect (RabbitMQ closes a link whose
            # token expired at its next publish or subscription)
            tokens = self.tokens
            renew = lambda: tokens.issue(Identity(user))  # noqa: E731
        return MqttLink(self.url, on_status, on_reconnect=on_reconnect, username=user or None,
                        password=password or None, tls=self.tls, renew=renew)


def start_mqtt(settings: Settings, authenticate: Authenticator) -> MqttSetup:
    """Start the embedded broker (``authenticate`` decides every CONNECT) or describe the external one."""
    if settings.broker_url != "embedded":
        user = settings.mqtt_username or ""
        password = settings.mqtt_password.get_secret_value() if settings.mqtt_password else ""
        if settings.broker_dynsec and not user:
            raise ConfigError("broker_dynsec needs the broker's dynamic-security admin credentials: set "
                              "PFL_MQTT_USERNAME and PFL_MQTT_PASSWORD")
        ext = ssl.create_default_context(cafile=str(settings.mqtt_ca_file) if settings.mqtt_ca_file else None)
        url = settings.broker_url
        mode: Mode = ("dynsec" if settings.broker_dynsec else "jwt" if settings.broker_tokens
                      else "hook" if settings.broker_hook_token else "shared")
        tokens = None
        if mode == "jwt":
            tokens = BrokerTokens(settings.broker_token_keys or settings.data_dir / "broker-keys",
                                  audience=settings.broker_token_audience, ttl_s=settings.broker_token_ttl_s,
                                  vhost=settings.broker_hook_vhost)
            user = user or SERVER_USER  # its password: a token of its own (MqttSetup.link)
        return MqttSetup(None, url, _device_url(settings, url, None), mode, (user, password),
                         ext if broker_tls(url) else None, tokens)
    port_file = settings.data_dir / "broker-port"
    port = settings.embedded_broker_port or _recorded_port(port_file)
    broker = EmbeddedBroker(settings.embedded_broker_host, port, authenticate=authenticate,
                            tls_cert=settings.broker_tls_cert, tls_key=settings.broker_tls_key,
                            max_per_address=settings.embedded_broker_max_per_address,
                            max_unauthenticated=settings.embedded_broker_max_unauthenticated,
                            v6_prefix=settings.http_ipv6_prefix)
    _device_url(settings, None, broker)  # refuses a loopback address before anything listens
    try:
        url = broker.start()
    except RuntimeError as e:
        if port is None:
            raise
        raise ConfigError(f"the embedded MQTT broker cannot listen on {settings.embedded_broker_host}:{port}, "
                          f"where enrolled devices look for it ({e}): free that port, or set "
                          f"PFL_EMBEDDED_BROKER_PORT to move the broker (enrolled devices that cannot reach the "
                          f"old address ask the server for the new one)") from None
    port_file.write_text(str(broker.port))
    if not loopback(settings.embedded_broker_host) and not broker.tls:
        log.warning("the embedded MQTT broker listens on %s without TLS: device passwords cross the network in "
                    "clear; set PFL_BROKER_TLS_CERT and PFL_BROKER_TLS_KEY", settings.embedded_broker_host)
    tls = None
    if broker.tls:
        # the server reaches its own broker on loopback: it pins the broker's certificate (or the CA given)
        tls = ssl.create_default_context(cafile=str(settings.mqtt_ca_file or settings.broker_tls_cert))
        tls.check_hostname = False
        tls.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return MqttSetup(broker, url, _device_url(settings, None, broker), "embedded",
                     (SERVER_USER, secrets.token_urlsafe(32)), tls)


def _recorded_port(port_file: Path) -> int | None:
    try:
        port = int(port_file.read_text())
    except (OSError, ValueError):
        return None
    return port if 0 < port < 65536 else None


def _device_url(settings: Settings, url: str | None, broker: EmbeddedBroker | None) -> str:
    """The broker's address for devices: ``public_broker_url``, else (embedded on every interface) this
    server's public host, else the address the server uses. Never loopback when ``public_url`` is not."""
    if settings.public_broker_url:
        out = settings.public_broker_url
    elif broker is not None:
        scheme = "mqtts" if broker.tls else "mqtt"
        bind = settings.embedded_broker_host
        host = (urlparse(settings.public_url).hostname or "127.0.0.1") if bind in ("0.0.0.0", "::", "") else bind
        host = f"[{host}]" if ":" in host else host
        out = f"{scheme}://{host}:{broker.port or 0}"
    else:
        out = url or ""
    broker_host, _ = parse_broker_url(out)
    public_host = urlparse(settings.public_url).hostname or ""
    if loopback(broker_host) and public_host and not loopback(public_host):
        raise ConfigError(
            f"devices reach this server at {settings.public_url} but would be told the MQTT broker is at {out}, a "
            f"loopback address they cannot reach: set PFL_PUBLIC_BROKER_URL to the broker's address as devices "
            f"see it (with the embedded broker, also PFL_EMBEDDED_BROKER_HOST, e.g. 0.0.0.0, and a certificate "
            f"in PFL_BROKER_TLS_CERT / PFL_BROKER_TLS_KEY)")
    return out


def init_dynsec(path: Path, admin: str, password: str) -> Path:
    """A Mosquitto ``dynamic-security.json`` at ``path`` (``mosquitto_ctrl dynsec init``) whose admin, the
    identity the server provisions devices with (``PFL_MQTT_USERNAME``/``PFL_MQTT_PASSWORD``), may also publish the
    federations' topics (``pfl/#``). ConfigError if ``mosquitto_ctrl`` is missing."""
    ctrl = shutil.which("mosquitto_ctrl")
    if ctrl is None:
        raise ConfigError("mosquitto_ctrl is not installed (Debian: apt-get install mosquitto-clients)")
    subprocess.run([ctrl, "dynsec", "init", str(path), admin], input=f"{password}\n{password}\n", text=True,
                   check=True, capture_output=True)
    conf = json.loads(path.read_text())
    for role in conf["roles"]:
        if role["rolename"] == "admin":
            role["acls"].append({"acltype": "publishClientSend", "topic": "pfl/#", "allow": True})
    path.write_text(json.dumps(conf))
    return path
