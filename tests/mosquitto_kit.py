"""Private Mosquitto brokers for the broker tests: anonymous, with the dynamic-security plugin (an admin client
that may also publish ``pfl/#``, as docs/settings describe for the server), and with a TLS listener."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from server.broker import free_port, listening
from server.broker_setup import init_dynsec

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
CTRL = shutil.which("mosquitto_ctrl")
DYNSEC = Path("/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so")
ADMIN = ("pfl-admin", "admin-password-for-tests")


def _dynsec_file(folder: Path) -> Path:
    """A dynamic-security.json whose admin role may also publish pfl/# (the server's own set-up helper)."""
    if CTRL is None or not DYNSEC.exists():
        pytest.skip("mosquitto_ctrl or the dynamic-security plugin is missing")
    return init_dynsec(folder / "dynamic-security.json", *ADMIN)


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
        while not listening(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mosquitto did not start: {(folder / 'mosquitto.log').read_text()[-2000:]}")
            time.sleep(0.05)
        yield f"{'mqtts' if tls else 'mqtt'}://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
