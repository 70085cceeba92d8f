"""HTTPS and the HTTP server's limits: a device enrols over HTTPS trusting the test CA and rotates its token there;
a device trusting another CA refuses the server at once; the CLI reads secrets from files; and >1,000 idle
connections to a server with the usual 1,024-descriptor limit neither take it down nor flood its log."""

from __future__ import annotations

import os
import resource
import socket
import stat
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_testkit import FEDPER, SECRET, closed

from edge_runtime.http import Http, ServerError
from pfl_edge.cli.parser import build_parser
from pfl_edge.errors import ConfigError
from server.launch import start_background, start_subprocess
from server.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tlskit import make_pki

ADMIN = "admin-token-for-tls-tests"


def test_a_device_enrols_over_https_and_refuses_another_ca(tmp_path: Path, broker_url: str) -> None:
    pki = make_pki(tmp_path / "pki")
    srv = start_background(Settings(data_dir=tmp_path / "data", broker_url=broker_url, admin_token=ADMIN,  # type: ignore[arg-type]
                                    tick_s=0.05, tls_cert=pki.cert, tls_key=pki.key))
    try:
        assert srv.url.startswith("https://")
        admin = Http(srv.url, 5, ca_file=str(pki.ca))
        admin.token = ADMIN
        admin.call("POST", "/v1/federations", json_body={"id": "t", "enrol_secret": SECRET, "config": FEDPER})
        dev = Http(srv.url, 5, ca_file=str(pki.ca))
        e = dev.call("POST", "/v1/devices", json_body={"federation": "t", "enrol_secret": SECRET,
                                                       "profile": "phone-mid"}).json()
        token_file = tmp_path / "state" / "token.json"
        token_file.parent.mkdir()
        dev.use_token(token_file, e["token"])
        assert dev.rotate_if_due()  # a fresh enrolment's expiry is not known: it rotates at once
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600 and dev.token != e["token"]
        assert not dev.rotate_if_due()  # not due again for half of its 30 days
        assert dev.call("GET", "/v1/federations/t").json()["id"] == "t"
        old = Http(srv.url, 5, ca_file=str(pki.ca))
        old.token = e["token"]
        with pytest.raises(ServerError) as refused:
            old.call("GET", "/v1/federations/t")
        assert refused.value.status == 401
        again = Http(srv.url, 5, ca_file=str(pki.ca))  # a restart: the rotated token is read back
        again.use_token(token_file, e["token"])
        assert again.token == dev.token
        # a device trusting another CA refuses the server at once (no retrying a certificate)
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="certificate does not verify"):
            Http(srv.url, 30, ca_file=str(pki.other_ca)).call("GET", "/healthz")
        assert time.monotonic() - t0 < 5
        with pytest.raises(httpx.HTTPError):  # plain HTTP gets nothing from an HTTPS server
            httpx.get(srv.url.replace("https://", "http://") + "/healthz", timeout=3)
        with pytest.raises(ConfigError, match="plain http"):
            Http(srv.url.replace("https://", "http://"), 5, ca_file=str(pki.ca))
        for h in (admin, dev, old, again):  # a TLS close waits for the peer's close_notify: close them first
            h.client.close()
    finally:
        srv.stop()


def test_cli_reads_secrets_from_files_and_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pfl_edge.cli.client import enrol_secret

    f = tmp_path / "secret"
    f.write_text("from-a-file-123\n")
    base = ["client", "--server", "https://10.0.0.2:8443", "--profile", "phone-mid", "--state-dir", "s"]
    p = build_parser()
    assert enrol_secret(p.parse_args([*base, "--enrol-secret-file", str(f)])) == "from-a-file-123"
    monkeypatch.setenv("PFL_ENROL_SECRET", "from-the-env-456")
    assert enrol_secret(p.parse_args(base)) == "from-the-env-456"
    assert enrol_secret(p.parse_args([*base, "--enrol-secret", "flag-789"])) == "flag-789"
    with pytest.raises(ConfigError, match="cannot read"):
        enrol_secret(p.parse_args([*base, "--enrol-secret-file", str(tmp_path / "none")]))
    a = p.parse_args(["server", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--admin-token-file", "t"])
    assert (str(a.tls_cert), str(a.tls_key), str(a.admin_token_file)) == ("c.pem", "k.pem", "t")


def test_a_thousand_idle_connections_do_not_take_the_server_down(tmp_path: Path, broker_url: str) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2400:
        if hard != resource.RLIM_INFINITY and hard < 2400:
            pytest.skip(f"the descriptor limit {hard} is too low for 1,100 client sockets")
        resource.setrlimit(resource.RLIMIT_NOFILE, (2400, hard))
    log = tmp_path / "server.log"
    srv = start_subprocess({"PFL_ADMIN_TOKEN": ADMIN, "PFL_DATA_DIR": str(tmp_path / "data"),
                            "PFL_BROKER_URL": broker_url, "PFL_HTTP_HEADER_TIMEOUT_S": "1",
                            "PFL_HTTP_MAX_CONNECTIONS_PER_ADDRESS": "0"},  # (else the cap resets them first)
                           nofile=1024, log=log)  # the usual limit: 1,100 idle clients exhaust it
    host, port = srv.url.removeprefix("http://").split(":")
    socks: list[socket.socket] = []
    try:
        for _ in range(1100):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, int(port)))
            socks.append(s)
        t0 = time.monotonic()
        ok = False
        while not ok and time.monotonic() - t0 < 30:
            try:
                ok = httpx.get(f"{srv.url}/healthz", timeout=5).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.2)
        waited = time.monotonic() - t0
        assert ok, "the server did not answer /healthz within 30 s of 1,100 idle connections"
        assert waited < 15, waited
        # the idle ones are closed by the header timeout: each reads EOF (within a generous bound)
        deadline = time.monotonic() + 20
        while sum(1 for s in socks[:50] if closed(s)) < 50 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sum(1 for s in socks[:50] if closed(s)) == 50
        assert log.stat().st_size < 100_000, log.read_text()[-2000:]
    finally:
        for s in socks:
            s.close()
        srv.stop()
