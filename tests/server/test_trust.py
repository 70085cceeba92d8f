"""Credentials and operations: token rotation, expiry and revocation, enrolment secret rotation, enrolment rate
limits and its verify cache, secrets from files, private state files, the upload quota and blob garbage
collection (with a restart that still recovers, on SQLite and PostgreSQL)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_testkit import FEDPER, SECRET, Dev, bearer, create, fed_state, perturbed, sha, wait_for
from sqlalchemy import select

from pfl_edge.codec import encode
from pfl_edge.split import take
from server import enrol_gate
from server.app import create_app
from server.db import Blob, Device, Round, Update
from server.enrol_gate import EnrolGate
from server.errors import Forbidden, TooManyRequests
from server.ratelimit import Buckets, FloodFilter
from server.settings import Settings, ensure_admin_token

ADMIN = "admin-token-for-trust-tests"


def _settings(tmp_path: Path, broker_url: str, **kw: Any) -> Settings:
    return Settings(data_dir=tmp_path / "data", broker_url=broker_url, admin_token=ADMIN, tick_s=0.05,  # type: ignore[arg-type]
                    **kw)


@pytest.fixture
def client(tmp_path: Path, broker_url: str) -> Iterator[TestClient]:
    with TestClient(create_app(_settings(tmp_path, broker_url))) as c:
        yield c


def coord(c: TestClient) -> Any:
    return c.app.state.pfl.coordinator  # type: ignore[attr-defined]


def devices_call(c: TestClient, d: Dev | dict[str, str]) -> int:
    h = d.h if isinstance(d, Dev) else d
    return c.get("/v1/federations/f", headers=h).status_code


def test_a_device_rotates_its_token_and_the_old_one_dies_at_once(client: TestClient) -> None:
    create(client, ADMIN, "f", FEDPER)
    a = Dev(client, "f")
    r = client.post("/v1/devices/me/token", headers=a.h, json=a.rotation())
    assert r.status_code == 200, r.text
    new = r.json()
    assert new["device_id"] == a.id and new["token"] != a.e["token"]
    assert abs(new["expires"] - (time.time() + 30 * 86400)) < 60
    assert devices_call(client, a) == 401
    assert devices_call(client, bearer(new["token"])) == 200
    assert client.post("/v1/devices/me/token").status_code == 401
    # the admin rotates a device's token (a leaked one): the device's current token dies
    r = client.post(f"/v1/federations/f/devices/{a.id}/token", headers=bearer(ADMIN))
    assert r.status_code == 200 and devices_call(client, bearer(new["token"])) == 401
    assert devices_call(client, bearer(r.json()["token"])) == 200
    assert client.post(f"/v1/federations/f/devices/{a.id}/token", headers=bearer(new["token"])).status_code == 401
    assert client.post("/v1/federations/f/devices/dev-nope/token", headers=bearer(ADMIN)).status_code == 404


def test_an_expired_token_is_refused(client: TestClient) -> None:
    create(client, ADMIN, "f", FEDPER)
    a = Dev(client, "f")
    with coord(client).store.write() as s:
        s.get(Device, a.id).token_expires = time.time() - 1
    r = client.get("/v1/federations/f", headers=a.h)
    assert r.status_code == 401 and "expired" in r.json()["detail"]
    assert client.post("/v1/devices/me/token", headers=a.h, json=a.rotation()).status_code == 401  # too late


def test_revocation_cuts_http_broker_and_rounds(tmp_path: Path) -> None:
    # the embedded broker: every device has its own broker password, which revocation forgets
    with TestClient(create_app(_settings(tmp_path, "embedded"))) as client:
        _revocation(client)


def _revocation(client: TestClient) -> None:
    removed: list[str] = []
    access = coord(client).broker_access  # the real one (server.services.broker_access), watched
    remove = access.remove_device

    def watched(dev_id: str) -> None:
        removed.append(dev_id)
        remove(dev_id)

    access.remove_device = watched
    create(client, ADMIN, "f", {**FEDPER, "clients": 4}, min_devices=3)
    body = {"federation": "f", "enrol_secret": SECRET, "profile": "phone-mid", "nonce": "ab" * 16}
    e = client.post("/v1/devices", json=body).json()
    h = bearer(e["token"])
    other = Dev(client, "f")
    assert client.post(f"/v1/federations/f/devices/{e['device_id']}/revoke", headers=h).status_code == 403
    r = client.post(f"/v1/federations/f/devices/{e['device_id']}/revoke", headers=bearer(ADMIN))
    assert r.status_code == 200 and r.json()["device_id"] == e["device_id"]
    assert removed == [e["device_id"]]
    with coord(client).store.read() as s:
        assert s.get(Device, e["device_id"]).mqtt_hash is None  # its broker password is forgotten
        assert s.get(Device, other.id).mqtt_hash is not None  # not another's
    got = client.get("/v1/federations/f", headers=h)
    assert got.status_code == 401 and "revoked" in got.json()["detail"]
    r = client.post("/v1/devices", json=body)  # its nonce does not bring it back
    assert r.status_code == 403 and "revoked" in r.json()["detail"]
    # round 1 opens once three live devices are enrolled; the revoked one is not among them
    b = Dev(client, "f")
    assert fed_state(client, ADMIN, "f") == (0, "open")
    Dev(client, "f")
    wait_for(lambda: fed_state(client, ADMIN, "f") == (1, "collecting"), what="round 1")
    tasks = coord(client).planner.tasks("f", 1)
    assert e["device_id"] not in {d for d, _ in tasks} and {b.id, other.id} <= {d for d, _ in tasks}
    assert len(tasks) == 3
    assert client.post("/v1/federations/f/devices/dev-x/revoke", headers=bearer(ADMIN)).status_code == 404


def test_enrol_secret_rotation(client: TestClient) -> None:
    create(client, ADMIN, "f", FEDPER)
    Dev(client, "f")  # the old secret verified once: it sits in the verify cache
    new = {"enrol_secret": "a-new-secret-456"}
    assert client.post("/v1/federations/f/enrol-secret", json=new).status_code == 401
    assert client.post("/v1/federations/f/enrol-secret", json={"enrol_secret": "short"},
                       headers=bearer(ADMIN)).status_code == 422
    assert client.post("/v1/federations/f/enrol-secret", json=new, headers=bearer(ADMIN)).status_code == 204
    body = {"federation": "f", "enrol_secret": SECRET, "profile": "phone-mid"}
    assert client.post("/v1/devices", json=body).status_code == 403
    assert client.post("/v1/devices", json={**body, **new}).status_code == 201
    assert client.post("/v1/federations/nope/enrol-secret", json=new, headers=bearer(ADMIN)).status_code == 404


def test_enrolment_rate_limit_per_address(tmp_path: Path, broker_url: str) -> None:
    s = _settings(tmp_path, broker_url, enrol_burst_per_address=3, enrol_rate_per_address=0.01)
    with TestClient(create_app(s)) as c:
        create(c, ADMIN, "f", FEDPER)
        ok = {"federation": "f", "enrol_secret": SECRET, "profile": "phone-mid"}
        assert c.post("/v1/devices", json=ok).status_code == 201  # honest enrolments spend nothing
        for _ in range(3):
            assert c.post("/v1/devices", json={**ok, "enrol_secret": "guess-guess"}).status_code == 403
        r = c.post("/v1/devices", json={**ok, "enrol_secret": "guess-guess"})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1 and set(r.json()) == {"detail"}
        # an empty bucket answers 429 to the right secret too: a guess learns nothing but "wait"
        assert c.post("/v1/devices", json=ok).status_code == 429


def _count_verifications(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The secrets the gate verifies with scrypt, in order."""
    calls: list[str] = []
    real = enrol_gate.verify_secret

    def counted(secret: str, stored: str) -> bool:
        calls.append(secret)
        return real(secret, stored)

    monkeypatch.setattr(enrol_gate, "verify_secret", counted)
    return calls


def test_enrol_gate_federation_bucket_cache_and_unknown_federation(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.db import hash_secret

    calls = _count_verifications(monkeypatch)
    t = [0.0]
    gate = EnrolGate(Buckets(100.0, 100, clock=lambda: t[0]), Buckets(1.0, 2, clock=lambda: t[0]))
    stored = hash_secret(SECRET)
    gate.check("f", SECRET, stored, "10.0.0.1")
    gate.check("f", SECRET, stored, "10.0.0.2")
    gate.check("f", SECRET, stored, "10.0.0.3")
    assert calls == [SECRET]  # the right secret again: one HMAC, no scrypt
    for i, (fed, st) in enumerate((("f", stored), ("nope", None))):  # wrong secret, unknown federation: alike
        with pytest.raises(Forbidden) as e:
            gate.check(fed, "wrong-guess", st, f"10.1.0.{i}")
        assert str(e.value).startswith("wrong enrol secret for federation")
    # the unknown federation paid a scrypt too (against a dummy hash), not a dictionary miss: counted, not timed
    # (a single time ratio failed once under load, 0.29 against 0.3)
    assert calls == [SECRET, "wrong-guess", "wrong-guess"]
    with pytest.raises(Forbidden):  # from yet other addresses: its wrong answer spends the bucket's last token
        gate.check("f", "wrong-again", stored, "10.2.0.1")
    gate.check("f", SECRET, stored, "10.2.0.2")  # the verified secret needs no federation token (EnrolGate's rule)
    with pytest.raises(TooManyRequests) as tm:  # a guess pays its scrypt and is told to wait
        gate.check("f", "wrong-3", stored, "10.2.0.3")
    assert tm.value.retry_after is not None and tm.value.headers == {"Retry-After": "1"}
    t[0] += 2.0  # refilled past the debt the 429'd wrong answer added (every wrong answer spends)
    with pytest.raises(Forbidden):
        gate.check("f", "wrong-3", stored, "10.2.0.4")


def test_enrol_gate_verifies_a_fleets_first_wave_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from server.db import hash_secret

    calls = _count_verifications(monkeypatch)
    gate = EnrolGate(Buckets(1.0, 2), Buckets(1.0, 2))  # a burst of 2: 8 concurrent scrypts would be refused
    stored = hash_secret(SECRET)
    errors: list[BaseException] = []

    def enrol(i: int) -> None:
        try:
            gate.check("f", SECRET, stored, f"10.0.0.{i}")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=enrol, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert errors == [] and calls == [SECRET]  # one scrypt; the others waited for its answer


def test_secrets_from_files_and_private_state(tmp_path: Path, broker_url: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "admin-token"
    f.write_text("token-from-a-file\n")
    monkeypatch.setenv("PFL_ADMIN_TOKEN_FILE", str(f))
    s = ensure_admin_token(Settings(data_dir=tmp_path / "data", broker_url=broker_url, tick_s=0.05))
    assert s.admin_token is not None and s.admin_token.get_secret_value() == "token-from-a-file"
    with TestClient(create_app(s)) as c:
        assert c.post("/v1/federations", json={"id": "f", "enrol_secret": SECRET, "config": FEDPER},
                      headers=bearer("token-from-a-file")).status_code == 201
    data = tmp_path / "data"
    assert stat.S_IMODE(os.stat(data).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(data / "blobs").st_mode) == 0o700
    for p in data.glob("state.db*"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in (data / "blobs").rglob("*") if p.is_file())
    monkeypatch.setenv("PFL_ADMIN_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(Exception, match="cannot read the secret file"):
        ensure_admin_token(Settings(data_dir=tmp_path / "data"))
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        Settings(tls_cert=tmp_path / "c.pem")


def test_upload_quota(client: TestClient) -> None:
    create(client, ADMIN, "f", FEDPER)
    a = Dev(client, "f")
    base = take(a.fm.init_state(), a.fm.base_keys(2))
    payloads = [encode(perturbed(base, i), model_id=a.fm.model_id, round=1) for i in range(5)]
    for p in payloads[:4]:
        a.put(p)
    assert a.put(payloads[0]) == sha(payloads[0])  # the same bytes again cost nothing
    r = client.put(f"/v1/blobs/{sha(payloads[4])}", content=payloads[4], headers=a.h)
    assert r.status_code == 429 and "quota" in r.json()["detail"]
    with coord(client).store.read() as s:
        assert s.get(Device, a.id).uploaded_bytes == sum(len(p) for p in payloads[:4])
        assert s.get(Blob, sha(payloads[4])) is None


def _round(c: TestClient, devs: list[Dev], t: int) -> list[str]:
    """Every device fetches its task's base and sends an update of round t; the update digests."""
    tasks = dict(coord(c).planner.tasks("g", t))
    out = []
    for i, d in enumerate(devs):
        base = d.get(tasks[d.id].base).tensors
        out.append(d.send(t, perturbed(base, 10 * t + i)))
    return out


def _wait_round(c: TestClient, t: int) -> None:
    wait_for(lambda: fed_state(c, ADMIN, "g") == (t, "collecting"), what=f"round {t}")


def _stored(c: TestClient) -> tuple[set[str], set[str]]:
    root = Path(c.app.state.pfl.settings.resolved_blob_dir)  # type: ignore[attr-defined]
    # the collector deletes rows, then files, holding the blob table's lock (this process's on SQLite, an advisory
    # lock on PostgreSQL, where replicas share it): a storing transaction waits for it to finish
    with coord(c).store.write(blobs="store") as s:
        files = {p.name for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")}
        rows = set(s.scalars(select(Blob.digest)))
    return files, rows


def _settled_store(c: TestClient) -> tuple[set[str], set[str]]:
    """A snapshot in which every file has its row: an upload or a server blob writes its file before the
    transaction that adds the row (outside the lock), so a snapshot may catch one between the two. A file that
    never gets its row fails the wait."""
    snap: list[tuple[set[str], set[str]]] = []

    def consistent() -> bool:
        snap[:] = [_stored(c)]
        return snap[0][0] == snap[0][1]

    wait_for(consistent, what="every blob file to have its row and every row its file")
    return snap[0]


def test_gc_keeps_what_recovery_and_the_last_rounds_need(tmp_path: Path, broker_url: str, database_url: str) -> None:
    s = _settings(tmp_path, broker_url, gc_keep_rounds=1, database_url=database_url)
    cfg = {**FEDPER, "rounds": 4}
    with TestClient(create_app(s)) as c:
        create(c, ADMIN, "g", cfg)
        devs = [Dev(c, "g") for _ in range(3)]
        ups: dict[int, list[str]] = {}
        for t in (1, 2):
            _wait_round(c, t)
            ups[t] = _round(c, devs, t)
        wait_for(lambda: fed_state(c, ADMIN, "g") == (3, "collecting"), what="round 3")
        wait_for(lambda: not set(ups[1]) & _stored(c)[0], what="round 1's updates collected")
        files, _ = _settled_store(c)  # no file without its row, no row without its file
        assert set(ups[2]) <= files  # the last K rounds' updates stay
        with coord(c).store.read() as ss:
            keep, _ = coord(c).gc.keep(ss, "g")
        assert files <= keep | set(ups[2])
        init = devs[0].e["init_digest"]
    with TestClient(create_app(s)) as c:  # a restart: round 3 is recovered from what was kept
        for d in devs:
            d.c = c
        assert devs[0].get(init) is not None
        _round(c, devs, 3)
        wait_for(lambda: fed_state(c, ADMIN, "g") == (4, "collecting"), what="round 4")
        _round(c, devs, 4)
        wait_for(lambda: fed_state(c, ADMIN, "g")[1] == "finished", what="finished")
        wait_for(lambda: not set(ups[2]) & _stored(c)[0], what="round 2's updates collected")
        files, _ = _settled_store(c)
        with coord(c).store.read() as ss:
            keep, _ = coord(c).gc.keep(ss, "g")
        assert files <= keep and init in files
        with coord(c).store.read() as ss:
            assert len(list(ss.scalars(select(Update)))) == 12  # the ledger outlives the bytes
            r1 = ss.get(Round, ("g", 1))
            assert r1 is not None and r1.base_digest not in files  # round 1's average: out of the window


def test_flood_filter_lets_one_emfile_record_through_per_period() -> None:
    import errno
    import logging

    t = [0.0]
    f = FloodFilter(every_s=10, clock=lambda: t[0])

    def rec(msg: str, exc: BaseException | None = None) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None,
                                 (type(exc), exc, None) if exc else None)

    emfile = OSError(errno.EMFILE, "Too many open files")
    assert f.filter(rec("socket.accept() out of system resource", emfile))
    assert sum(f.filter(rec("accept failed", emfile)) for _ in range(1000)) == 0
    assert f.filter(rec("something else"))
    t[0] = 11.0
    r = rec("accept failed", emfile)
    assert f.filter(r) and "1000 more like it" in r.getMessage()
