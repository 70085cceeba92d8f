"""Helpers of the server tests: tiny federations, device-like HTTP clients, payloads good and bad, a device's
side of a round (built from ``pfl_edge.algorithms``, as the agent builds it), and a snapshot of every table to
check that a refused request changed nothing."""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import torch
from sqlalchemy import Engine, MetaData, select

from edge_runtime.data import LocalData
from pfl_edge.algorithms import Clients, Trainer, central, dispfl, one_row
from pfl_edge.codec import Decoded, decode, encode
from pfl_edge.device_key import enrol_message, new_key, public_of, rotate_message, sign
from pfl_edge.federation import FederationConfig, Stream, model_id, stream
from pfl_edge.protocol import mqtt_client_id
from pfl_edge.split import Split
from pfl_edge.train import train, unstack
from server.db import Base
from server.fedmodel import FedModel, fed_model

SECRET = "enrol-secret-123"
QUICK: dict[str, Any] = dict(dataset="synthetic", partition="pathological:2", samples_per_client=48,
                             test_per_client=32, local_epochs=1, batch_size=16, lr=0.05, workers=1, seed=3)
FEDPER: dict[str, Any] = dict(algorithm="fedper", kp=2, clients=3, rounds=2, **QUICK)
DISPFL: dict[str, Any] = dict(algorithm="dispfl", densities=[0.3, 0.6, 1.0], topology="random:2", clients=4,
                              rounds=2, **QUICK)


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def background_server(tmp_path: Path, broker_url: str, admin: str) -> Any:
    """A server in this process on a fresh SQLite file and ``broker_url``, ticking every 50 ms (stop it)."""
    from server.launch import start_background
    from server.settings import Settings

    return start_background(Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'state.db'}",
                                      broker_url=broker_url, admin_token=admin, tick_s=0.05))  # type: ignore[arg-type]


def app_with_federation(tmp_path: Path, broker_url: str, admin: str) -> Iterator[Any]:
    """The body of a ``client`` fixture: the app in a TestClient, federation ``f`` of FEDPER created."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    s = Settings(data_dir=tmp_path / "data", broker_url=broker_url, admin_token=admin, tick_s=0.05)  # type: ignore[arg-type]
    with TestClient(create_app(s)) as c:
        create(c, admin, "f", FEDPER)
        yield c


def create(c: httpx.Client | Any, admin: str, fed: str, config: dict[str, Any], **kw: Any) -> dict[str, Any]:
    r = c.post("/v1/federations", json={"id": fed, "enrol_secret": SECRET, "config": config, **kw},
               headers=bearer(admin))
    assert r.status_code == 201, r.text
    return dict(r.json())


class Dev:
    """A device as the server sees it: enrolment, blobs, updates, over HTTP."""

    def __init__(self, c: httpx.Client | Any, fed: str, profile: str = "phone-mid", index: int | None = None,
                 platform: dict[str, Any] | None = None, nonce: str | None = None, keyed: bool = True,
                 protocols: tuple[int, ...] = (1, 2)) -> None:
        """``keyed``: enrol with a nonce (``nonce``, else a random one), a key (pfl_edge.device_key) and
        ``protocols`` (default 1 and 2); not ``keyed``: as a device of an earlier release (protocol 1), with
        ``nonce`` if given."""
        self.c = c
        body: dict[str, Any] = {"federation": fed, "enrol_secret": SECRET, "profile": profile}
        if index is not None:
            body["index"] = index
        if platform is not None:
            body["platform"] = platform
        self.key: str | None = None
        self.counter = 1
        if keyed:
            nonce = nonce or secrets.token_hex(16)
            self.key = new_key()
            public = public_of(self.key)
            body.update(public_key=public, proof={"counter": 1, "signature": sign(
                self.key, enrol_message(fed, nonce, public, 1))}, protocols=list(protocols))
        if nonce is not None:
            body["nonce"] = nonce
        r = c.post("/v1/devices", json=body)
        assert r.status_code == 201, r.text
        self.e: dict[str, Any] = r.json()
        self.id: str = self.e["device_id"]
        self.index: int = self.e["index"]
        self.h = bearer(self.e["token"])
        self.fm: FedModel = fed_model(self.e["config"])
        # its MQTT client id: one no other device can guess where it enrolled with a key
        self.client_id: str = self.e.get("mqtt_client_id") or mqtt_client_id(self.id)

    def rotation(self) -> dict[str, Any] | None:
        """The body of its own token rotation: a signed proof with its next counter (None without a key)."""
        if self.key is None:
            return None
        self.counter += 1
        return {"proof": {"counter": self.counter, "signature": sign(self.key, rotate_message(self.id, self.counter))}}

    def get(self, digest: str) -> Decoded:
        r = self.c.get(f"/v1/blobs/{digest}", headers=self.h)
        assert r.status_code == 200, r.text
        return decode(r.content)

    def put(self, payload: bytes) -> str:
        d = sha(payload)
        r = self.c.put(f"/v1/blobs/{d}", content=payload, headers=self.h)
        assert r.status_code in (200, 201), r.text
        return d

    def update(self, t: int, digest: str, n: int = 48) -> httpx.Response:
        return self.c.post(f"/v1/rounds/{t}/updates", json={"digest": digest, "n_samples": n}, headers=self.h)

    def send(self, t: int, tensors: dict[str, torch.Tensor], n: int = 48,
             masks: dict[str, torch.Tensor] | None = None) -> str:
        d = self.put(encode(tensors, model_id=self.fm.model_id, round=t, masks=masks))
        r = self.update(t, d, n)
        assert r.status_code == 200, r.text
        return d


def train_one(data: LocalData, state: dict[str, torch.Tensor], cfg: FederationConfig, t: int,
              slot: int) -> dict[str, torch.Tensor]:
    """Local training of round ``t`` for the device of ``slot``, as the simulator trains that client."""
    res = train(data.model, one_row(state), data.train, torch.tensor([0]), cfg.train_config(t),
                [stream(cfg.seed, Stream.TRAIN, t, slot)], engine="loop")
    return unstack(res.stack, 0)


def base_payload(state: dict[str, torch.Tensor], split: Split, data: LocalData, t: int) -> bytes:
    """A FedPer device's upload: its base part only."""
    return encode(central.upload(state, split), model_id=model_id(data.spec), round=t)


def dispfl_initial(cfg: FederationConfig, data: LocalData, slot: int, density: float,
                   init: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A DisPFL device's sparse initial model and the masks that travel with it (its training support)."""
    clients = Clients(cfg, data.model, trainer=cast(Trainer, None),  # init_clients trains nothing
                      slots=torch.tensor([slot]), n_train=torch.tensor([data.n_train]))
    st = dispfl.init_clients(clients, init, [density])
    return unstack(st.weights, 0), dispfl.sent_masks(unstack(st.support, 0))


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def with_nan(payload: bytes) -> bytes:
    """A payload whose first float is NaN, with a valid sha256 trailer (so only the NaN check can refuse it)."""
    body = bytearray(payload[:-32])
    head_len = struct.unpack_from("<I", body, 5)[0]
    struct.pack_into("<f", body, 9 + head_len, float("nan"))
    return bytes(body) + hashlib.sha256(body).digest()


def snapshot(engine: Engine) -> dict[str, list[str]]:
    """Every row of every server table, as sorted JSON (device liveness excluded: MQTT may touch it; the rate
    limits' buckets, which a refused attempt is meant to spend: that is how a guesser is slowed; and a device's
    count of refused updates, which a refused update is meant to raise)."""
    out: dict[str, list[str]] = {}
    md: MetaData = Base.metadata
    with engine.connect() as conn:
        for name, table in md.tables.items():
            if name == "pfl_rate_buckets":
                continue
            rows = []
            for row in conn.execute(select(table)).mappings():
                d = {k: v for k, v in row.items() if k not in ("online", "last_seen", "refused_updates")}
                rows.append(json.dumps(d, sort_keys=True, default=str))
            out[name] = sorted(rows)
    return out


def wait_for(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def settled(srv: Any, *, past: float | None = None, timeout: float = 30.0) -> None:
    """Wait until the server's round worker has run one whole tick that began after now (and after unix time
    ``past``, e.g. a round's deadline): whatever a tick would do with what the test did so far, it has done. The
    event a check that something did *not* happen waits for, instead of a sleep."""
    worker = srv.app_state.coordinator.worker
    if past is not None:
        wait_for(lambda: time.time() > past, timeout=timeout + max(0.0, past - time.time()), what="the deadline")
    start = worker.ticks
    # ticks run one after another in one thread: the second start after ``start`` means a whole tick ran
    wait_for(lambda: worker.ticks >= start + 2, timeout=timeout, what="a whole tick of the round worker")


def fed_state(c: httpx.Client | Any, admin: str, fed: str) -> tuple[int, str]:
    j = c.get(f"/v1/federations/{fed}", headers=bearer(admin)).json()
    return int(j["round"]), str(j["state"])


class Mqtt:
    """A device-like paho client: keeps the latest message per topic."""

    def __init__(self, url: str, topics: list[str], *, client_id: str = "", clean: bool = True,
                 will: tuple[str, bytes] | None = None, username: str | None = None, password: str | None = None,
                 keepalive: int = 10) -> None:
        import threading

        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        from server.mqtt import parse_broker_url

        host, port = parse_broker_url(url)
        self.latest: dict[str, bytes] = {}
        self.all: list[tuple[str, bytes, bool]] = []
        self._cv = threading.Condition()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean)
        if will is not None:
            self.c.will_set(will[0], will[1], qos=1, retain=True)
        if username is not None:
            self.c.username_pw_set(username, password)
        connected = threading.Event()

        def on_connect(c: Any, _u: Any, _f: Any, _rc: Any, _p: Any) -> None:
            for t in topics:
                c.subscribe(t, qos=1)
            connected.set()

        def on_message(_c: Any, _u: Any, m: Any) -> None:
            with self._cv:
                self.latest[m.topic] = bytes(m.payload)
                self.all.append((m.topic, bytes(m.payload), bool(m.retain)))
                self._cv.notify_all()

        self.c.on_connect = on_connect
        self.c.on_message = on_message
        self.c.connect(host, port, keepalive=keepalive)
        self.c.loop_start()
        assert connected.wait(10), "MQTT connect timed out"

    def publish(self, topic: str, payload: bytes, retain: bool = True) -> None:
        self.c.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def wait(self, topic: str, pred: Callable[[dict[str, Any]], bool] = lambda _: True,
             timeout: float = 20.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                raw = self.latest.get(topic)
                if raw:
                    msg = json.loads(raw)
                    if pred(msg):
                        return dict(msg)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching message on {topic} within {timeout} s; latest: {raw!r:.300}")
                self._cv.wait(left)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()

    def die(self) -> None:
        """The device loses power: the socket closes without a DISCONNECT, so the broker sends the last will."""
        import socket

        self.c.loop_stop()
        sock = cast(socket.socket | None, self.c.socket())
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def closed(s: socket.socket) -> bool:
    """Whether the server closed a non-blocking socket: EOF, or a reset (a socket closed with unread bytes is
    reset)."""
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


BETA = 0.25  # the toy mixing algorithm's (``mixing_algorithm``)


@contextlib.contextmanager
def mixing_algorithm() -> Iterator[str]:
    """A toy algorithm whose aggregate is not a weighted mean, registered while the block runs: FedPer's base mixed
    with the last one, beta * (what FedPer's aggregate gives) + (1 - beta) * prev (pFedMe's server step). A server
    that bypassed the algorithm's aggregate would publish FedPer's."""
    from pfl_edge.algorithms import algorithm as registry
    from pfl_edge.algorithms.central import FedPer

    class Mixing(FedPer):
        def aggregate(self, prev, updates, **kw):  # type: ignore[no-untyped-def]
            new = super().aggregate(prev, updates, **kw)
            assert new is not None
            return {k: (BETA * v.double() + (1 - BETA) * prev[k].double()).to(v.dtype) for k, v in new.items()}

    registry.register_algorithm("toy-mixing")(Mixing)
    try:
        yield "toy-mixing"
    finally:
        del registry._REGISTRY["toy-mixing"]
