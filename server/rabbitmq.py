"""RabbitMQ as the devices' broker: its configuration for the server's HTTP hook (``rabbitmq_conf``: what
``docker/rabbitmq.conf`` holds for compose's replicated profile), and a private cluster of RabbitMQ nodes on
this machine for the tests and benchmarks (``start_cluster``).

RabbitMQ's MQTT plugin authenticates every client and authorises every virtual host, queue, exchange and
topic by asking the server (``rabbitmq_auth_backend_http``; ``server.routers.broker_hook``), so nothing is
provisioned per device and a cluster of any size needs no per-device state of its own. Retained messages are
kept per node in RabbitMQ 3.x: a device that connects to another node does not see a retained task, so the
device fetches its task over HTTP whenever it (re)connects (``edge_runtime.agent``)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from pfl_edge.errors import ConfigError

__all__ = ["CACHE", "OAUTH2", "RABBITMQ_SERVER", "RabbitCluster", "TokenKeys", "rabbitmq_conf", "start_cluster"]

RABBITMQ_SERVER = next((p for p in ("/usr/lib/rabbitmq/bin/rabbitmq-server",) if Path(p).exists()),
                       shutil.which("rabbitmq-server"))
PLUGINS = ("rabbitmq_mqtt", "rabbitmq_auth_backend_http")
OAUTH2 = "rabbitmq_auth_backend_oauth2"
CACHE = "rabbitmq_auth_backend_cache"


@dataclass(frozen=True)
class TokenKeys:
    """What RabbitMQ's oauth2 backend checks devices' tokens with (``server.services.broker_tokens``): the
    resource server id (the tokens' ``aud`` and their scopes' prefix) and every public key by kid."""

    resource_server_id: str
    keys: dict[str, Path]


def rabbitmq_conf(hook_url: str | None, *, mqtt_listener: str = "1883", amqp_listener: str | None = None,
                  nodes: tuple[str, ...] = (), tokens: TokenKeys | None = None,
                  hook_cache_s: float | None = None) -> str:
    """rabbitmq.conf for devices on MQTT authenticated by the server's hook at ``hook_url``
    (``<server>/v1/broker/hook/<broker_hook_token>``: a listener devices cannot reach, such as HAProxy's
    ``hook_bind`` in compose's replicated set, since the token is the hook's only secret), or by their signed
    tokens (``tokens``: the oauth2 backend first, with no call out; the hook, if also given, second: asked only
    for a password that is no valid token); ``hook_cache_s``: the hook's answers cached that long per node
    (``rabbitmq_auth_backend_cache``: a revoked device keeps its access until its cached answers expire);
    ``nodes``: a cluster's node names (classic peer discovery: the nodes find each other at their first start)."""
    lines = [f"mqtt.listeners.tcp.default = {mqtt_listener}", "mqtt.allow_anonymous = false", "mqtt.vhost = /"]
    if tokens is not None:
        lines += ["auth_backends.1 = rabbit_auth_backend_oauth2",  # (no short name in 3.10)
                  f"auth_oauth2.resource_server_id = {tokens.resource_server_id}"]
        lines += [f"auth_oauth2.signing_keys.{kid} = {path}" for kid, path in sorted(tokens.keys.items())]
        lines.append("auth_oauth2.algorithms.1 = ES256")
    if hook_url is not None:
        backend = "http" if hook_cache_s is None else "cache"
        lines += [f"auth_backends.{1 if tokens is None else 2} = {backend}", "auth_http.http_method = post",
                  f"auth_http.user_path = {hook_url}/user", f"auth_http.vhost_path = {hook_url}/vhost",
                  f"auth_http.resource_path = {hook_url}/resource", f"auth_http.topic_path = {hook_url}/topic"]
        if hook_cache_s is not None:
            if hook_cache_s <= 0:
                raise ConfigError(f"hook_cache_s must be positive, got {hook_cache_s}")
            lines += ["auth_cache.cached_backend = http", f"auth_cache.cache_ttl = {round(hook_cache_s * 1000)}"]
    if amqp_listener is not None:
        lines.insert(0, f"listeners.tcp.default = {amqp_listener}")
    if nodes:
        lines.append("cluster_formation.peer_discovery_backend = classic_config")
        lines += [f"cluster_formation.classic_config.nodes.{i} = {n}" for i, n in enumerate(nodes, 1)]
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RabbitCluster:
    """Private RabbitMQ nodes (``start_cluster``); :attr:`mqtt_urls` one per node."""

    folder: Path
    names: list[str]
    mqtt_ports: list[int]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def mqtt_urls(self) -> list[str]:
        return [f"mqtt://127.0.0.1:{p}" for p in self.mqtt_ports]

    def _eval(self, expr: str) -> str:
        ctl = Path(RABBITMQ_SERVER or "").with_name("rabbitmqctl")
        out = subprocess.run([str(ctl), "-n", self.names[0], "eval", expr], capture_output=True, text=True,
                             timeout=60, env=_env())
        return out.stdout

    def running_nodes(self) -> list[str]:
        """The cluster's running nodes, as its first node sees them."""
        out = self._eval("rabbit_nodes:all_running().")
        return sorted(n for n in self.names if n in out)

    def nodes_that_accepted(self, client_id: str) -> list[str]:
        """The nodes whose log records an MQTT connection accepted from a client id matching the regular
        expression ``client_id`` since they started: every connection counts, however short (a sample of the
        cluster's client list, each question seconds long under load, missed those of a federation over in
        seconds)."""
        mark = re.compile(f"client id: {client_id}")
        found = []
        for i, name in enumerate(self.names):
            log = self.folder / f"node-{i}" / "log" / f"{name}.log"
            try:
                text = log.read_text(errors="replace")
            except OSError:
                continue
            if any("accepting MQTT connection" in line and mark.search(line) for line in text.splitlines()):
                found.append(name)
        return sorted(found)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the node's Erlang VM and its helpers (epmd is shared: kept)
        for p in self.procs:
            p.wait(30)
        self.procs.clear()


def _env() -> dict[str, str]:
    # run as this user with its own Erlang cookie (Debian's /usr/sbin wrappers switch to the rabbitmq user)
    return {**os.environ, "HOME": os.environ.get("HOME", "/root")}


def start_cluster(folder: Path, n: int, hook_url: str | None, *, timeout_s: float = 180.0,
                  tokens: TokenKeys | None = None, hook_cache_s: float | None = None) -> RabbitCluster:
    """``n`` RabbitMQ nodes clustered on this machine, each with its own ports and data under ``folder``,
    devices authenticated by the hook at ``hook_url`` (its answers cached ``hook_cache_s``) and/or by their
    tokens (``tokens``: the oauth2 backend enabled); returns once every node takes MQTT connections and the
    cluster has formed. ConfigError where RabbitMQ is not installed."""
    if RABBITMQ_SERVER is None:
        raise ConfigError("RabbitMQ is not installed (Debian: apt-get install rabbitmq-server)")
    for attempt in range(3):
        try:
            return _start_cluster(RABBITMQ_SERVER, folder / f"try-{attempt}", n, hook_url, timeout_s, tokens,
                                  hook_cache_s)
        except _PortTaken:  # a free port another process took between our probe and the node's bind
            continue
    raise ConfigError("RabbitMQ nodes found their ports taken three times running; is the machine short of ports?")


class _PortTaken(ConfigError):
    pass


def _start_cluster(exe: str, folder: Path, n: int, hook_url: str | None, timeout_s: float, tokens: TokenKeys | None,
                   hook_cache_s: float | None) -> RabbitCluster:
    tag = f"pfl{os.getpid() % 100000}x{int(time.time() * 1000) % 100000}"
    names = [f"{tag}n{i}@localhost" for i in range(n)]
    ports = [_free_port() for _ in range(n)]
    cluster = RabbitCluster(folder, names, ports)
    try:
        for i, name in enumerate(names):
            d = folder / f"node-{i}"
            d.mkdir(parents=True, exist_ok=True)
            amqp, dist = _free_port(), _free_port()
            (d / "rabbitmq.conf").write_text(rabbitmq_conf(hook_url, mqtt_listener=f"127.0.0.1:{ports[i]}",
                                                           amqp_listener=f"127.0.0.1:{amqp}", nodes=tuple(names),
                                                           tokens=tokens, hook_cache_s=hook_cache_s))
            plugins = (PLUGINS + ((OAUTH2,) if tokens is not None else ())
                       + ((CACHE,) if hook_cache_s is not None else ()))
            (d / "enabled_plugins").write_text(f"[{','.join(plugins)}].\n")
            env = {**_env(), "RABBITMQ_NODENAME": name, "RABBITMQ_NODE_PORT": str(amqp),
                   "RABBITMQ_DIST_PORT": str(dist), "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
                   "RABBITMQ_LOG_BASE": str(d / "log"), "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq"),
                   "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
                   "RABBITMQ_PID_FILE": str(d / "pid"), "RABBITMQ_FEATURE_FLAGS_FILE": str(d / "feature_flags"),
                   "RABBITMQ_PLUGINS_EXPAND_DIR": str(d / "plugins-expand"),
                   "ERL_CRASH_DUMP": str(d / "erl_crash.dump")}
            log = open(d / "out.log", "ab")  # noqa: SIM115  (the child owns it)
            cluster.procs.append(subprocess.Popen([exe], env=env, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True))
        deadline = time.monotonic() + timeout_s
        for i, port in enumerate(ports):
            while True:
                if cluster.procs[i].poll() is not None:
                    out, dump = folder / f"node-{i}" / "out.log", folder / f"node-{i}" / "erl_crash.dump"
                    text = "".join(p.read_text(errors="replace")[:4000] for p in (out, dump) if p.exists())
                    err = _PortTaken if "already_used" in text or "eaddrinuse" in text else ConfigError
                    raise err(f"RabbitMQ node {names[i]} exited; see {out}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise ConfigError(f"RabbitMQ node {names[i]} did not listen within {timeout_s:.0f} s") from None
                    time.sleep(0.2)
        while cluster.running_nodes() != sorted(names):
            if time.monotonic() > deadline:
                raise ConfigError(f"the RabbitMQ nodes did not form a cluster within {timeout_s:.0f} s")
            time.sleep(0.5)
    except BaseException:
        cluster.stop()
        raise
    return cluster
