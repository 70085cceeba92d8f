"""Private Mosquitto brokers for the broker tests: anonymous, with the dynamic-security plugin (an admin client
that may also publish ``pfl/#``, as docs/settings describe for the server), and with a TLS listener."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from server.broker import free_port

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
CTRL = shutil.which("mosquitto_ctrl")
DYNSEC = Path("/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so")
ADMIN = ("pfl-admin", "admin-password-for-tests")


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _dynsec_file(folder: Path) -> Path:
    """A dynamic-security.json from ``mosquitto_ctrl dynsec init`` whose admin role may also publish pfl/#."""
    if CTRL is None or not DYNSEC.exists():
        pytest.skip("mosquitto_ctrl or the dynamic-security plugin is missing")
    path = folder / "dynamic-security.json"
    subprocess.run([CTRL, "dynsec", "init", str(path), ADMIN[0]], input=f"{ADMIN[1]}\n{ADMIN[1]}\n", text=True,
                   check=True, capture_output=True)
    conf = json.loads(path.read_text())
    for role in conf["roles"]:
        if role["rolename"] == "admin":
            role["acls"].append({"acltype": "publishClientSend", "topic": "pfl/#", "allow": True})
    path.write_text(json.dumps(conf))
    return path


@contextmanager
def mosquitto(folder: Path, *, dynsec: bool = False, tls: tuple[Path, Path] | None = None) -> Iterator[str]:
    """A private Mosquitto on a free loopback port; yields its URL (mqtts:// with ``tls`` = (cert, key))."""
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    lines = ["user root", f"listener {port} 127.0.0.1", "persistence false"]
    if tls is not None:
        lines += [f"certfile {tls[0]}", f"keyfile {tls[1]}"]
    if dynsec:
        lines += [f"plugin {DYNSEC}", f"plugin_opt_config_file {_dynsec_file(folder)}", "allow_anonymous false"]
    else:
        lines.append("allow_anonymous true")
    conf = folder / "mosquitto.conf"
    conf.write_text("\n".join(lines) + "\n")
    log = (folder / "mosquitto.log").open("w")
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not _answers(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mosquitto did not start: {(folder / 'mosquitto.log').read_text()[-2000:]}")
            time.sleep(0.05)
        yield f"{'mqtts' if tls else 'mqtt'}://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
