"""The container files without a container engine: compose.yaml's server environment is exactly what
server.settings.Settings reads and parses; the Dockerfile runs as a non-root user with a stdlib HEALTHCHECK; and
the image's command, run here with compose's environment pointed at a local Mosquitto (started by compose's own
docker/mosquitto-entrypoint.sh and mosquitto.conf) and PostgreSQL, is healthy by that HEALTHCHECK and provisions
an enrolled device on the broker."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from pgkit import schema_or_skip

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
COMPOSE, DOCKERFILE, DOCKER = ROOT / "compose.yaml", ROOT / "Dockerfile", ROOT / "docker"
SECRETS = {"PFL_ADMIN_TOKEN": "admin-" + uuid.uuid4().hex, "PFL_MQTT_PASSWORD": "mqtt-" + uuid.uuid4().hex,
           "POSTGRES_PASSWORD": "pg-" + uuid.uuid4().hex}
MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
DYNSEC_PLUGIN = Path("/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so")

# compose's interpolation: $$, ${V}, ${V:-default}, ${V-default}, ${V:?error}, ${V?error}, $V
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_]\w*)(?:(:?)([-?])([^}]*))?\}|\$([A-Za-z_]\w*)")


def interpolate(value: str, env: Mapping[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(5)
        got = env.get(name)
        missing = got is None or (m.group(2) == ":" and got == "")
        if m.group(3) == "?" and missing:
            raise KeyError(f"{name}: {m.group(4)}")
        if m.group(3) == "-" and missing:
            return m.group(4)
        return got or ""

    return _VAR.sub(one, value)


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def server_env(env: Mapping[str, str]) -> dict[str, str]:
    raw = compose()["services"]["server"]["environment"]
    return {k: interpolate(str(v), env) for k, v in raw.items()}


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in DOCKERFILE.read_text().splitlines()
                                          if not ln.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def instruction(name: str) -> str:
    found = [rest for word, rest in dockerfile() if word == name]
    assert found, f"the Dockerfile has no {name}"
    return found[-1]  # Docker uses the last one


def healthcheck_argv() -> list[str]:
    """The HEALTHCHECK's exec-form command, its image paths mapped back to the repository files COPY put there."""
    argv = json.loads(instruction("HEALTHCHECK").split(" CMD ", 1)[1])
    copies = {}
    for word, rest in dockerfile():
        if word == "COPY" and not rest.startswith("--"):
            *srcs, dest = rest.split()
            if len(srcs) == 1:
                copies[dest] = str(ROOT / srcs[0])
    return [sys.executable if a == "python" else copies.get(a, a) for a in argv]


def image_argv() -> list[str]:
    return list(json.loads(instruction("ENTRYPOINT"))) + list(json.loads(instruction("CMD")))


# ----------------------------------------------------------------------------------------------- static checks
def test_compose_wires_the_server_to_a_healthy_broker_and_database() -> None:
    services = compose()["services"]
    assert set(services) == {"server", "mosquitto", "postgres"}
    server = services["server"]
    assert server["build"] == "."
    assert server["depends_on"] == {"mosquitto": {"condition": "service_healthy"},
                                    "postgres": {"condition": "service_healthy"}}
    # the registry's images unless told others (docker/debian/images.sh names its own)
    assert interpolate(services["server"]["image"], {}) == "pfl-edge-server"
    assert interpolate(services["postgres"]["image"], {}).startswith("postgres:16")
    assert "pg_isready" in services["postgres"]["healthcheck"]["test"]
    assert interpolate(services["mosquitto"]["image"], {}).startswith("eclipse-mosquitto:2")
    assert interpolate(services["mosquitto"]["image"], {"PFL_MOSQUITTO_IMAGE": "m:1"}) == "m:1"
    assert "healthcheck" in services["mosquitto"]
    volumes = set(compose()["volumes"])
    for svc in services.values():
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).is_file(), f"{v}: compose mounts a file the repository lacks"
            else:
                assert src in volumes, f"{v}: not a named volume"
    env = server_env(SECRETS)
    # the server's data, the database and the broker are where the other services are
    assert env["PFL_DATA_DIR"] == "/data" and "server-data:/data" in server["volumes"]
    assert env["PFL_DATABASE_URL"] == f"postgresql://pfl:{SECRETS['POSTGRES_PASSWORD']}@postgres:5432/pfl"
    assert env["PFL_BROKER_URL"] == "mqtt://mosquitto:1883"


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_compose_has_no_default_secret(missing: str) -> None:
    """Every secret is required from the environment (compose refuses to start without it), none committed."""
    env = {k: v for k, v in SECRETS.items() if k != missing}
    with pytest.raises(KeyError, match=missing):
        server_env(env)
    for k, v in server_env(SECRETS).items():
        raw = str(compose()["services"]["server"]["environment"][k])
        if SECRETS[missing] in v:
            assert "${" + missing + ":?" in raw, f"{k} takes {missing} with a default"


def test_every_pfl_variable_is_a_setting_and_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.broker_setup import start_mqtt
    from server.settings import Settings

    prefix = Settings.model_config["env_prefix"]
    env = server_env(SECRETS)
    for k in env:
        assert k.startswith(prefix) and k[len(prefix):].lower() in Settings.model_fields, f"{k} is not a setting"
    for k in list(os.environ):
        if k.startswith(prefix):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = Settings()
    assert s.admin_token is not None and s.admin_token.get_secret_value() == SECRETS["PFL_ADMIN_TOKEN"]
    assert s.mqtt_password is not None and s.mqtt_password.get_secret_value() == SECRETS["PFL_MQTT_PASSWORD"]
    assert s.broker_dynsec is True and s.mqtt_username == "pfl-server"
    assert s.resolved_database_url.startswith("postgresql+psycopg://pfl:")
    assert str(s.data_dir) == "/data"
    mqtt = start_mqtt(s, lambda *_: None)  # an external broker: describes it, connects nothing
    assert mqtt.mode == "dynsec" and mqtt.url == "mqtt://mosquitto:1883"
    assert mqtt.device_url == "mqtt://127.0.0.1:1883"  # compose's default for devices on this host
    # devices elsewhere (PFL_PUBLIC_URL) with the broker's default loopback address: the server refuses to start
    from pfl_edge.errors import ConfigError

    monkeypatch.setenv("PFL_PUBLIC_URL", "http://pfl.example.org:8080")
    with pytest.raises(ConfigError, match="PFL_PUBLIC_BROKER_URL"):
        start_mqtt(Settings(), lambda *_: None)


def test_dockerfile_runs_the_server_as_a_fixed_non_root_user_with_a_healthcheck() -> None:
    user = instruction("USER")
    assert user not in ("root", "0") and not user.startswith("0:")
    useradd = next(rest for word, rest in dockerfile() if word == "RUN" and "useradd" in rest)
    assert re.search(rf"useradd\b.*\b{re.escape(user)}\b", useradd)
    uid = int(re.search(r"ARG PFL_UID=(\d+)", "\n".join(f"{w} {r}" for w, r in dockerfile())).group(1))  # type: ignore[union-attr]
    assert uid >= 1000
    assert "chown pfl:pfl /data" in useradd
    argv = image_argv()
    assert argv == ["pfl-edge", "server", "--host", "0.0.0.0", "--port", "8080"]
    assert instruction("EXPOSE") == argv[argv.index("--port") + 1]
    assert "--start-period" in instruction("HEALTHCHECK")
    hc = healthcheck_argv()
    assert hc[0] == sys.executable and Path(hc[1]) == DOCKER / "healthcheck.py"
    # stdlib only: the slim image has none of the project's HTTP clients on its probe's path
    assert not re.search(r"^\s*(import|from)\s+(httpx|requests|pfl_edge|server)", (DOCKER / "healthcheck.py")
                         .read_text(), re.M)


def test_every_copied_path_reaches_the_build_and_no_secret_does() -> None:
    """What COPY names exists and .dockerignore lets it through; what holds secrets or bulk is kept out."""
    import fnmatch

    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]

    def excluded(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/"))
                   for pat in ignored for p in prefixes)

    for word, rest in dockerfile():
        if word == "COPY" and not rest.startswith("--from="):  # --from= copies from a build stage
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                assert not excluded(src), f"COPY {src}: excluded by .dockerignore"
    for private in (".env", "prod.env", ".venv", ".git", "tests", "server/__pycache__/x.pyc",
                    "devices/js/node_modules/x", "base.tar"):
        assert excluded(private), f"{private} would be sent to the build"


# -------------------------------------------------------------------------- the image's command, run here
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout_s:.0f} s")
        time.sleep(0.2)


@pytest.fixture
def pg_schema_url() -> Iterator[str]:
    """postgresql://... whose search_path is a fresh schema of database ``test``, dropped afterwards."""
    with schema_or_skip("pfl_ct") as url:
        yield url


@pytest.fixture
def compose_mosquitto(tmp_path: Path) -> Iterator[str]:
    """compose's Mosquitto: docker/mosquitto-entrypoint.sh with docker/mosquitto.conf, its container paths
    rewritten to a temp dir, this machine's plugin path and a free loopback port."""
    if MOSQUITTO is None or shutil.which("mosquitto_ctrl") is None or not DYNSEC_PLUGIN.exists():
        pytest.skip("mosquitto, mosquitto_ctrl or the dynamic-security plugin is missing")
    port = _free_port()
    conf = (DOCKER / "mosquitto.conf").read_text()
    assert "listener 1883\n" in conf and "/usr/lib/mosquitto_dynamic_security.so" in conf
    conf = (conf.replace("listener 1883\n", f"listener {port} 127.0.0.1\n")
            .replace("/usr/lib/mosquitto_dynamic_security.so", str(DYNSEC_PLUGIN))
            .replace("/mosquitto/data", str(tmp_path)))
    conf += "user root\n" if os.geteuid() == 0 else ""  # as root, Mosquitto would drop to a user owning nothing here
    (tmp_path / "mosquitto.conf").write_text(conf)
    env = {**os.environ, "MOSQUITTO_CONF": str(tmp_path / "mosquitto.conf"),
           "PFL_MQTT_USERNAME": "pfl-server", "PFL_MQTT_PASSWORD": SECRETS["PFL_MQTT_PASSWORD"],
           "PATH": f"{Path(MOSQUITTO).parent}:{os.environ.get('PATH', '')}"}
    with (tmp_path / "mosquitto.log").open("w") as log:
        proc = subprocess.Popen(["sh", str(DOCKER / "mosquitto-entrypoint.sh")], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"mosquitto exited: {(tmp_path / 'mosquitto.log').read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return True
            except OSError:
                return False

        _wait(up, 15, "Mosquitto did not listen")
        dynsec = json.loads((tmp_path / "dynamic-security.json").read_text())
        assert oct((tmp_path / "dynamic-security.json").stat().st_mode & 0o777) == "0o600"
        admin = next(r for r in dynsec["roles"] if r["rolename"] == "admin")
        assert {"acltype": "publishClientSend", "topic": "pfl/#", "allow": True} in admin["acls"]
        yield f"mqtt://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def _mqtt_connects(url: str, client_id: str, user: str, password: str) -> int | None:
    """The CONNACK reason code of one connection (0: accepted), None for no answer."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    host, port = url.removeprefix("mqtt://").rsplit(":", 1)
    got: list[int] = []
    done = threading.Event()

    def on_connect(_c: Any, _u: Any, _f: Any, rc: Any, _p: Any = None) -> None:
        got.append(int(rc.value) if hasattr(rc, "value") else int(rc))
        done.set()

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311,
                    reconnect_on_failure=False)
    c.username_pw_set(user, password)
    c.on_connect = on_connect
    c.connect(host, int(port))
    c.loop_start()
    try:
        done.wait(5)
    finally:
        c.disconnect()
        c.loop_stop()
    return got[0] if got else None


def test_the_image_command_is_healthy_with_compose_environment(
        tmp_path: Path, compose_mosquitto: str, pg_schema_url: str) -> None:
    exe = Path(sys.executable).parent / "pfl-edge"
    if not exe.exists():
        pytest.skip(f"{exe} is not installed (pip install -e .)")
    port = _free_port()
    argv = image_argv()
    argv[0], argv[argv.index("--port") + 1] = str(exe), str(port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PFL_")}
    env.update(server_env(SECRETS))
    env.update(PFL_DATA_DIR=str(tmp_path / "data"), PFL_DATABASE_URL=pg_schema_url,
               PFL_BROKER_URL=compose_mosquitto, PFL_PUBLIC_BROKER_URL=compose_mosquitto,
               PFL_PUBLIC_URL=f"http://127.0.0.1:{port}", PFL_DECODE_PROCESSES="0")
    probe_env = {**env, "HEALTHCHECK_URL": f"http://127.0.0.1:{port}/healthz"}

    def healthy() -> bool:
        return subprocess.run(healthcheck_argv(), env=probe_env, capture_output=True, timeout=30).returncode == 0

    assert not healthy()  # nothing listens yet: the probe must say so
    with (tmp_path / "server.log").open("w") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        def up() -> bool:
            if server.poll() is not None:
                pytest.fail(f"the server exited: {(tmp_path / 'server.log').read_text()[-3000:]}")
            return healthy()

        _wait(up, 90, "the HEALTHCHECK command did not pass")
        url = f"http://127.0.0.1:{port}"
        health = httpx.get(f"{url}/healthz", timeout=5).json()
        assert health["database"] is True and health["mqtt"] is True and health["status"] == "ok"
        # the dynamic-security mode for real: an enrolled device gets its own working MQTT login
        admin = {"Authorization": f"Bearer {SECRETS['PFL_ADMIN_TOKEN']}"}
        config = {"algorithm": "fedper", "model": "cnn", "dataset": "synthetic", "clients": 2, "rounds": 1}
        r = httpx.post(f"{url}/v1/federations", headers=admin, timeout=30,
                       json={"id": "ct", "enrol_secret": "s" * 16, "config": config})
        assert r.status_code == 201, r.text
        r = httpx.post(f"{url}/v1/devices", timeout=30, json={"federation": "ct", "enrol_secret": "s" * 16,
                                                              "profile": "raspberry-pi-4"})
        assert r.status_code == 201, r.text
        e = r.json()
        assert e["broker_url"] == compose_mosquitto
        cid = e.get("mqtt_client_id") or f"pfl-{e['device_id']}"  # a keyless device of version 1: the old id
        assert _mqtt_connects(compose_mosquitto, cid, e["mqtt_username"], e["mqtt_password"]) == 0
        assert _mqtt_connects(compose_mosquitto, cid, e["mqtt_username"], "wrong") not in (0, None)
        # compose's Mosquitto healthcheck, on this broker's port
        test = compose()["services"]["mosquitto"]["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL"
        cmd = interpolate(test[1], {}).replace("-p 1883", f"-p {compose_mosquitto.rsplit(':', 1)[1]}")
        menv = {**os.environ, "PFL_MQTT_USERNAME": "pfl-server", "PFL_MQTT_PASSWORD": SECRETS["PFL_MQTT_PASSWORD"]}
        assert subprocess.run(["sh", "-c", cmd], env=menv, capture_output=True, timeout=30).returncode == 0
    finally:
        server.terminate()
        server.wait(30)
    assert not healthy()  # and once the server is gone


# ------------------------------------------------------------------------------- replicas (compose.replicated)
REPLICATED = ROOT / "compose.replicated.yaml"
REPLICATED_SECRETS = {**SECRETS, "PFL_BROKER_HOOK_TOKEN": "hook-" + uuid.uuid4().hex}


def test_the_replicated_set_shares_one_database_blob_store_and_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three replicas behind HAProxy: each one's environment parses as the server's settings and asks for the
    hook mode on RabbitMQ; they share the blobs and programs volume and each has its own data volume; no secret
    has a default."""
    from server.broker_setup import start_mqtt
    from server.settings import Settings

    spec = dict(yaml.safe_load(REPLICATED.read_text()))
    services = spec["services"]
    assert set(services) == {"replica-1", "replica-2", "replica-3", "haproxy", "rabbitmq", "postgres"}
    own = set()
    for name in ("replica-1", "replica-2", "replica-3"):
        svc = services[name]
        assert svc["build"] == "." and "shared:/shared" in svc["volumes"]
        own |= {v for v in svc["volumes"] if v.endswith(":/data")}
        env = {k: interpolate(str(v), REPLICATED_SECRETS) for k, v in svc["environment"].items()}
        for k in list(os.environ):
            if k.startswith("PFL_"):
                monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        s = Settings()
        assert s.resolved_database_url.startswith("postgresql+psycopg://pfl:")
        assert str(s.resolved_blob_dir).startswith("/shared/") and str(s.programs_dir).startswith("/shared/")
        assert s.partial_sums  # the leader merges the replicas' sums at close
        mqtt = start_mqtt(s, lambda *_: None)
        assert mqtt.mode == "hook" and mqtt.url == "mqtt://rabbitmq:1883"
        for secret in REPLICATED_SECRETS:
            with pytest.raises(KeyError, match=secret):
                {k: interpolate(str(v), {x: y for x, y in REPLICATED_SECRETS.items() if x != secret})
                 for k, v in svc["environment"].items()}
    assert len(own) == 3  # a data dir each (the spool of uploads in flight)
    for v in [*services["haproxy"]["volumes"], *services["rabbitmq"]["volumes"]]:
        src = v.split(":")[0]
        if src.startswith("./"):
            assert (ROOT / src).is_file(), f"{v}: compose mounts a file the repository lacks"
    assert interpolate(str(services["rabbitmq"]["environment"]["PFL_BROKER_HOOK_TOKEN"]), REPLICATED_SECRETS) \
        == REPLICATED_SECRETS["PFL_BROKER_HOOK_TOKEN"]


def test_the_hook_listener_is_internal_and_only_the_balancer_is_believed_about_addresses() -> None:
    """RabbitMQ asks the hook on HAProxy's own hook listener (8081), which compose does not publish; the devices'
    port (8080) is the only one published; every replica believes X-Forwarded-For from HAProxy's fixed address
    only, which lies in the compose network's subnet, outside the range other containers are given."""
    import ipaddress

    spec = dict(yaml.safe_load(REPLICATED.read_text()))
    lb = spec["services"]["haproxy"]
    assert [interpolate(p, {}) for p in lb["ports"]] == ["8080:8080"] and "8081" in [str(p) for p in lb["expose"]]
    cfg = (DOCKER / "haproxy.cfg").read_text()
    assert "bind *:8081" in cfg and "option forwardfor" in cfg
    assert "haproxy:8081/v1/broker/hook/" in (DOCKER / "rabbitmq-entrypoint.sh").read_text()
    address = ipaddress.ip_address(lb["networks"]["default"]["ipv4_address"])
    ipam = spec["networks"]["default"]["ipam"]["config"][0]
    assert address in ipaddress.ip_network(ipam["subnet"]) and address not in ipaddress.ip_network(ipam["ip_range"])
    for name in ("replica-1", "replica-2", "replica-3"):
        assert spec["services"][name]["environment"]["PFL_FORWARDED_ALLOW_IPS"] == str(address)


def test_the_balancer_and_broker_configs_are_the_servers_own(tmp_path: Path) -> None:
    """docker/haproxy.cfg is server.balancer.haproxy_config's for the three replicas, and HAProxy accepts it;
    the RabbitMQ container's entrypoint writes server.rabbitmq.rabbitmq_conf's lines for the hook behind the
    balancer, with the token from the environment, then runs its arguments."""
    from server.balancer import HAPROXY, haproxy_config
    from server.rabbitmq import rabbitmq_conf

    cfg = (DOCKER / "haproxy.cfg").read_text()
    body = "".join(ln + "\n" for ln in cfg.splitlines() if not ln.startswith("#"))
    assert body == haproxy_config("*:8080", ["replica-1:8080", "replica-2:8080", "replica-3:8080"],
                                  dns="resolv.conf", hook_bind="*:8081")
    if HAPROXY is not None:
        check = subprocess.run([HAPROXY, "-c", "-f", str(DOCKER / "haproxy.cfg")], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    token = REPLICATED_SECRETS["PFL_BROKER_HOOK_TOKEN"]
    out = tmp_path / "20-pfl.conf"
    env = {"PATH": os.environ["PATH"], "PFL_BROKER_HOOK_TOKEN": token, "PFL_RABBITMQ_CONF": str(out)}
    ran = subprocess.run(["sh", str(DOCKER / "rabbitmq-entrypoint.sh"), "sh", "-c", "echo started"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0 and ran.stdout.strip() == "started", ran.stderr
    assert out.read_text() == rabbitmq_conf(f"http://haproxy:8081/v1/broker/hook/{token}")
    assert out.stat().st_mode & 0o077 == 0  # the token is a secret
    missing = subprocess.run(["sh", str(DOCKER / "rabbitmq-entrypoint.sh"), "true"], capture_output=True, text=True,
                             env={"PATH": os.environ["PATH"], "PFL_RABBITMQ_CONF": str(tmp_path / "no.conf")})
    assert missing.returncode != 0 and "PFL_BROKER_HOOK_TOKEN" in missing.stderr
