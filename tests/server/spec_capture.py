"""A whole FedPer federation (2 devices, 2 rounds) driven over the wire as docs/protocol.md's "minimal device"
does it, every HTTP exchange and MQTT message recorded with the schema it must satisfy.

``tests/server/test_spec_routes.py`` validates each recorded message against its served schema; run as a script
(``.venv/bin/python tests/server/spec_capture.py``) it prints the exchanges as JSON, the source of the examples
in docs/protocol.md. The devices train and evaluate for real (the simulator's training of their slot, the
algorithm's own evaluation), so their metrics and sample counts are what a device would send."""

from __future__ import annotations

import hashlib
import json
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_testkit import FEDPER, SECRET, Mqtt, bearer, wait_for

from edge_runtime.data import load_local_data
from pfl_edge.algorithms import central, one_row
from pfl_edge.codec import decode, encode
from pfl_edge.device_key import enrol_message, new_key, public_of, rotate_message, sign
from pfl_edge.federation import FederationConfig, Stream, init_state, model_id, stream
from pfl_edge.split import split_keys
from pfl_edge.train import evaluate, train, unstack
from server.launch import BackgroundServer, start_background
from server.settings import Settings

FED = "demo"
CONFIG: dict[str, Any] = {**FEDPER, "clients": 2, "rounds": 2}


@dataclass
class Exchange:
    """One HTTP call (``method``, ``path``, request and answer) or one MQTT message (``method`` "MQTT")."""

    step: str
    method: str
    path: str
    status: int | None
    request: Any = None
    response: Any = None
    request_schema: str | None = None
    response_schema: str | None = None
    device: str | None = None  # the device that sent or received it


@dataclass
class Capture:
    srv: BackgroundServer
    c: httpx.Client
    log: list[Exchange] = field(default_factory=list)
    who: dict[str, str] = field(default_factory=dict)  # token -> device id

    def call(self, step: str, method: str, path: str, *, token: str | None = None, body: Any = None,
             content: bytes | None = None, req: str | None = None, resp: str | None = None) -> httpx.Response:
        r = self.c.request(method, path, json=body, content=content,
                           headers=None if token is None else bearer(token))
        shown: Any = r.json() if r.headers.get("content-type", "").startswith("application/json") else (
            f"<{len(r.content)} bytes>")
        sent = body if content is None else f"<{len(content)} bytes>"
        self.log.append(Exchange(step, method, path, r.status_code, sent, shown, req, resp,
                                 None if token is None else self.who.get(token)))
        return r

    def mqtt(self, step: str, topic: str, payload: bytes, schema: str, device: str) -> dict[str, Any]:
        msg = json.loads(payload)
        self.log.append(Exchange(step, "MQTT", topic, None, None, msg, None, schema, device))
        return dict(msg)


class Device:
    """The minimal device of docs/protocol.md, in Python: enrol, connect, fetch its task, download, train,
    upload, update, report."""

    def __init__(self, cap: Capture, index: int) -> None:
        self.cap = cap
        self.nonce = secrets.token_hex(16)
        self.key, self.counter = new_key(), 1  # its own key: it signs its enrolment and its token rotations
        public = public_of(self.key)
        proof = {"counter": 1, "signature": sign(self.key, enrol_message(FED, self.nonce, public, 1))}
        body = {"federation": FED, "enrol_secret": SECRET, "profile": "phone-mid", "name": f"dev{index}",
                "index": index, "nonce": self.nonce, "n_samples": 48, "public_key": public, "proof": proof,
                "protocols": [1, 2]}
        self.e = cap.call("enrol", "POST", "/v1/devices", body=body, req="EnrolRequest", resp="Enrolment").json()
        self.id, self.token = self.e["device_id"], self.e["token"]
        cap.log[-1].device, cap.who[self.token] = self.id, self.id
        self.cfg = FederationConfig.from_dict(self.e["config"])
        self.data = load_local_data(self.cfg, self.e["index"])
        self.split = split_keys(self.data.model, self.e["kp"], local_norm_stats=self.cfg.local_norm_stats)
        self.down = 0  # bytes downloaded for the current round
        base = self.download(self.e["init_digest"])
        # personal tensors start from the federation's seeded initial model (they never travel)
        self.state = {**init_state(self.cfg, self.data.spec), **base}
        self.trained_in = 0
        self.stats: dict[int, dict[str, Any]] = {}
        self.heard = 0
        self.mq = Mqtt(self.e["broker_url"], [f"pfl/{FED}/round", f"pfl/{FED}/device/{self.id}/task"],
                       client_id=self.e["mqtt_client_id"], clean=False, username=self.e["mqtt_username"],
                       password=self.e["mqtt_password"],
                       will=(f"pfl/{FED}/device/{self.id}/status",
                             json.dumps({"device_id": self.id, "state": "offline"}).encode()))
        online = json.dumps({"device_id": self.id, "state": "online"}).encode()
        self.mq.c.publish(f"pfl/{FED}/device/{self.id}/status", online, qos=1, retain=True).wait_for_publish(10)
        cap.log.append(Exchange("status", "MQTT", f"pfl/{FED}/device/{self.id}/status", None, None,
                                json.loads(online), None, "DeviceStatus", self.id))

    def download(self, digest: str) -> dict[str, torch.Tensor]:
        r = self.cap.call("download", "GET", f"/v1/blobs/{digest}", token=self.token)
        self.down += len(r.content)
        if hashlib.sha256(r.content).hexdigest() != digest:
            raise AssertionError("blob content does not match its digest")
        return dict(decode(r.content, model_id=model_id(self.data.spec)).tensors)

    def bell(self) -> None:
        """Record the MQTT messages it received since the last bell."""
        msgs = self.mq.all[self.heard:]
        self.heard += len(msgs)
        for topic, payload, _retained in msgs:
            self.cap.mqtt("mqtt", topic, payload, "Task" if topic.endswith("/task") else "RoundAnnouncement",
                          self.id)

    def task(self) -> dict[str, Any]:
        self.bell()
        r = self.cap.call("task", "GET", "/v1/rounds/current/task", token=self.token, resp="Task")
        return dict(r.json())

    def metrics(self, t: int) -> None:
        acc, loss = evaluate(self.data.model, one_row(self.state), self.data.test, torch.tensor([0]))
        body = {"accuracy": float(acc[0]), "loss": float(loss[0]), "n_test": self.data.n_test, **self.stats[t]}
        self.cap.call("metrics", "POST", f"/v1/rounds/{t}/metrics", token=self.token, body=body,
                      req="MetricsReport", resp="MetricsStored")

    def act(self, task: dict[str, Any]) -> None:
        """One task: put the base on, report the round it last trained in, train, upload its base part."""
        t = task["round"]
        self.down = 0
        self.state.update(self.download(task["base"]))
        if self.trained_in >= 1:  # FedPer: metrics of the round it last trained in, on the new base
            self.metrics(self.trained_in)
        if task["final"]:
            return
        start = time.monotonic()
        res = train(self.data.model, one_row(self.state), self.data.train, torch.tensor([0]), self.cfg.train_config(t),
                    [stream(self.cfg.seed, Stream.TRAIN, t, self.e["index"])], engine="loop")
        self.state = unstack(res.stack, 0)
        train_s = round(time.monotonic() - start, 3)
        payload = encode(central.upload(self.state, self.split), model_id=model_id(self.data.spec), round=t)
        digest = hashlib.sha256(payload).hexdigest()
        self.cap.call("upload", "PUT", f"/v1/blobs/{digest}", token=self.token, content=payload, resp="BlobStored")
        body = {"digest": digest, "n_samples": self.data.n_train, "train_loss": float(res.loss[0]),
                "train_s": train_s, "bytes_down": self.down}
        self.cap.call("update", "POST", f"/v1/rounds/{t}/updates", token=self.token, body=body,
                      req="UpdateRequest", resp="UpdateAccepted")
        self.trained_in = t
        self.stats[t] = {"bytes_up": len(payload), "bytes_down": self.down, "train_s": train_s}


def _state(cap: Capture) -> tuple[int, str]:
    j = cap.c.get(f"/v1/federations/{FED}", headers=bearer(cap.srv.admin_token)).json()
    return int(j["round"]), str(j["state"])


def _reached(cap: Capture, want: tuple[int, str]) -> Callable[[], bool]:
    return lambda: _state(cap) == want


def _errors(cap: Capture, d: Device) -> None:
    """The refusals a device meets, as the server words them."""
    cap.call("error", "GET", "/v1/rounds/current/task", resp="ErrorBody")  # no token: 401
    cap.call("error", "GET", f"/v1/blobs/{'0' * 64}", token=d.token, resp="ErrorBody")  # 404
    cap.call("error", "POST", "/v1/rounds/1/updates", token=d.token, resp="ErrorBody",
             body={"digest": "0" * 64, "n_samples": 0, "extra": 1})  # 422, a list of issues
    cap.call("error", "POST", "/v1/rounds/2/updates", token=d.token, resp="ErrorBody",
             body={"digest": "0" * 64, "n_samples": 48})  # 409: it sent another update for round 2


def run(srv: BackgroundServer) -> list[Exchange]:
    """The whole federation on ``srv`` (tick_s small, embedded broker); every exchange in order."""
    cap = Capture(srv, httpx.Client(base_url=srv.url, timeout=60))
    cap.call("health", "GET", "/healthz")
    cap.call("create", "POST", "/v1/federations", token=srv.admin_token, req="FederationCreate",
             resp="FederationInfo", body={"id": FED, "enrol_secret": SECRET, "config": CONFIG, "deadline_s": 600})
    devs = [Device(cap, i) for i in range(2)]
    try:
        for t in (1, 2):
            wait_for(_reached(cap, (t, "collecting")), 60, f"round {t}")
            for d in devs:
                d.act(d.task())
        wait_for(lambda: _state(cap)[1] == "finished", 60, "finished")
        for d in devs:
            d.act(d.task())  # the final task
        time.sleep(0.3)  # the last retained messages
        for d in devs:
            d.bell()
        a = devs[0]
        cap.call("info", "GET", f"/v1/federations/{FED}", token=a.token, resp="FederationInfo")
        cap.call("broker", "GET", "/v1/devices/me/broker", token=a.token, resp="BrokerInfo")
        a.counter += 1
        rotation = {"proof": {"counter": a.counter, "signature": sign(a.key, rotate_message(a.id, a.counter))}}
        r = cap.call("token", "POST", "/v1/devices/me/token", token=a.token, body=rotation, req="TokenRotation",
                     resp="TokenIssued")
        a.token = r.json()["token"]
        cap.who[a.token] = a.id
        _errors(cap, a)
        return cap.log
    finally:
        for d in devs:
            d.mq.c.disconnect()
            d.mq.c.loop_stop()


def serve(tmp: Path) -> BackgroundServer:
    return start_background(Settings(data_dir=tmp / "data", database_url=f"sqlite:///{tmp / 'state.db'}",
                                     tick_s=0.05))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        server = serve(Path(d))
        try:
            for x in run(server):
                print(json.dumps(x.__dict__))
        finally:
            server.stop()
