"""A minimal pfl-edge device written from the specification alone (docs/protocol.md, docs/codec.md,
docs/algorithms.md "DisPFL", the server's /openapi.json). It imports nothing of this repository: only the
standard library, httpx, paho-mqtt, numpy and its own ``codec.py`` beside it.

It does not learn. Its "training" is deterministic so that a test can check every value it sends:

- FedPer: every base tensor it receives gets ``+ delta`` on every element (``--delta``, default 0.01); it has no
  personal blocks and uploads exactly the tensors of the base it downloaded, dense float32.
- DisPFL: after averaging with its in-neighbours over the masks that travel with their models, it applies its
  own mask, adds ``delta`` on the mask and uploads the result with that mask. It never prunes or regrows: its
  mask (ERK at its density, drawn once from ``--seed``) stays the one it started with.

It has no test data: its metrics say ``n_test`` 0, accuracy 0 and, as loss, the mean absolute change its
training made (a number a reader can check). protocol.md says a device without test data posts no metrics; this
one posts them so that the tests can check their round numbers.

Run: ``python tests/spec_device/device.py --server URL --federation FED --enrol-secret S --index 2 --state-dir D``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import codec  # this folder's codec.py: run as a script, the script's folder is first on sys.path
import httpx
import numpy as np

API = "/v1"
RETRY_STATUS = {429, 500, 502, 503, 504}
MAX_BLOB = 64 * 2**20  # the server's default max_blob_bytes
log = logging.getLogger("spec-device")


class Server:
    """The HTTP side (protocol.md "HTTP API"): JSON calls with the bearer token, retried with back-off (0.5 s
    doubling to 10 s) on transport errors, 429 (honouring ``Retry-After``) and 5xx, for ``patience_s``."""

    def __init__(self, url: str, patience_s: float) -> None:
        self.http = httpx.Client(base_url=url, timeout=30.0)
        self.patience_s = patience_s
        self.token = ""
        self.bytes_down = 0

    def call(self, method: str, path: str, headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
        headers = {**(headers or {}), **({"Authorization": f"Bearer {self.token}"} if self.token else {})}
        delay, deadline = 0.5, time.monotonic() + self.patience_s
        while True:
            try:
                r = self.http.request(method, path, headers=headers, **kw)
                if r.status_code not in RETRY_STATUS:
                    return r
                wait = float(r.headers.get("Retry-After", delay)) if r.status_code == 429 else delay
            except httpx.TransportError as e:
                log.warning("%s %s: %s", method, path, e)
                wait = delay
            if time.monotonic() + wait > deadline:
                raise RuntimeError(f"{method} {path}: no answer within {self.patience_s:.0f} s")
            time.sleep(wait)
            delay = min(delay * 2, 10.0)

    def ok(self, method: str, path: str, **kw: Any) -> Any:
        r = self.call(method, path, **kw)
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:300]}")
        return r.json() if r.content and r.headers.get("content-type", "").startswith("application/json") else None

    def blob(self, digest: str) -> bytes:
        """GET /v1/blobs/{sha256}: the bytes must hash to the name we asked for."""
        r = self.call("GET", f"{API}/blobs/{digest}")
        if r.status_code != 200:
            raise RuntimeError(f"blob {digest[:12]}: {r.status_code} {r.text[:200]}")
        if hashlib.sha256(r.content).hexdigest() != digest:
            raise RuntimeError(f"blob {digest[:12]}: the bytes do not match their digest")
        self.bytes_down += len(r.content)
        return r.content

    def upload(self, payload: bytes, t: int, n_samples: int, loss: float) -> bool:
        """PUT the blob under its sha256, then POST it as this device's update of round t. False: 409, the round
        closed without it (protocol.md "Errors": drop this round's work)."""
        digest = hashlib.sha256(payload).hexdigest()
        self.ok("PUT", f"{API}/blobs/{digest}", content=payload, headers={"Content-Type": "application/octet-stream"})
        body = {"digest": digest, "n_samples": n_samples, "train_loss": loss, "bytes_down": self.bytes_down}
        r = self.call("POST", f"{API}/rounds/{t}/updates", json=body)
        if r.status_code == 409:
            log.warning("round %d: update refused (%s); dropped", t, r.text[:200])
            return False
        if r.status_code != 200:
            raise RuntimeError(f"update of round {t}: {r.status_code} {r.text[:300]}")
        got = r.json()
        log.info("round %d: update %s accepted=%s (%d updates)", t, digest[:12], got["accepted"], got["updates"])
        return True


class Doorbell:
    """MQTT (protocol.md "MQTT topics", "A minimal device" step 2): with the enrolment's credentials, subscribe to
    the federation's round topic and this device's own task topic; a message that passes the checks of "What a
    device checks on every MQTT message" (1-3) only wakes the HTTP poll, which is what the device acts on (4).
    Announces its status ``online`` (retained) and leaves ``offline`` as its last will (5)."""

    def __init__(self, enr: dict[str, Any]) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.event = threading.Event()
        self.connected = threading.Event()  # set by the broker's CONNACK (the subscriptions follow it)
        fed, dev = enr["federation"], enr["device_id"]
        # everything the callbacks read is set before the network thread starts: a CONNACK can come back at once
        self.fed, self.dev, self.done = fed, dev, -1  # done: the last round whose task it finished (the loop keeps it)
        self.topics = (f"pfl/{fed}/round", f"pfl/{fed}/device/{dev}/task")
        self.status_topic = f"pfl/{fed}/device/{dev}/status"
        url = urlsplit(enr["broker_url"])
        cid = enr.get("mqtt_client_id") or f"pfl-{dev}"  # absent: a server of an earlier release
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid,
                                  protocol=mqtt.MQTTv311, clean_session=False)
        self.client.username_pw_set(enr["mqtt_username"], enr["mqtt_password"])
        offline = json.dumps({"device_id": dev, "state": "offline"})
        self.client.will_set(self.status_topic, offline, qos=1, retain=True)
        if url.scheme == "mqtts":
            self.client.tls_set()
        self.client.on_connect = self._connected
        self.client.on_message = self._message
        self.client.reconnect_delay_set(1, 30)
        self.client.connect_async(url.hostname or "127.0.0.1", url.port or (8883 if url.scheme == "mqtts" else 1883))
        self.client.loop_start()

    def _connected(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any = None) -> None:
        log.info("mqtt: connected (%s)", reason)
        client.subscribe([(t, 1) for t in self.topics])
        self.connected.set()
        client.publish(self.status_topic, json.dumps({"device_id": self.dev, "state": "online"}), qos=1, retain=True)

    def _message(self, client: Any, userdata: Any, msg: Any) -> None:
        if msg.topic not in self.topics:  # string equality: a broker may deliver other retained topics
            log.warning("mqtt: ignoring a message on %s", msg.topic)
            return
        if not msg.payload or len(msg.payload) > 2**20:  # a cleared retained message, or far too big
            return
        try:
            body = json.loads(msg.payload)
        except ValueError:
            log.warning("mqtt: not JSON on %s", msg.topic)
            return
        if not isinstance(body, dict) or body.get("federation") != self.fed or type(body.get("round")) is not int:
            log.warning("mqtt: ignoring a message that is not for %s", self.fed)
            return
        rnd = body["round"]
        if msg.topic.endswith("/task") and rnd < self.done:  # a stale task
            return
        log.info("mqtt: bell on %s (round %d)", msg.topic, rnd)
        self.event.set()

    def wait(self, seconds: float) -> None:
        self.event.wait(seconds)
        self.event.clear()

    def close(self) -> None:
        offline = json.dumps({"device_id": self.dev, "state": "offline"})
        self.client.publish(self.status_topic, offline, qos=1, retain=True).wait_for_publish(5)
        self.client.disconnect()
        self.client.loop_stop()


def enrol(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    """POST /v1/devices. The nonce is chosen and saved before asking, so a retry whose answer was lost gets the
    same device back; the enrolment is saved so that a restart does not enrol again."""
    state = Path(args.state_dir)
    saved = state / "enrolment.json"
    if saved.exists():
        return dict(json.loads(saved.read_text()))
    nonce_file = state / "nonce"
    if not nonce_file.exists():
        nonce_file.write_text(secrets.token_hex(16))
    body = {"federation": args.federation, "enrol_secret": args.enrol_secret, "profile": args.profile,
            "name": args.name, "index": args.index, "nonce": nonce_file.read_text(), "n_samples": args.n_samples}
    r = srv.call("POST", f"{API}/devices", json=body)
    if r.status_code != 201:
        raise RuntimeError(f"enrolment refused: {r.status_code} {r.text[:300]}")
    enr = dict(r.json())
    saved.write_text(json.dumps(enr))
    log.info("enrolled as %s, slot %d, density %s, round %d", enr["device_id"], enr["index"], enr["density"],
             enr["round"])
    return enr


DATASETS = {"fashion-mnist": (10, 1, 28), "synthetic": (10, 1, 28), "cifar10": (10, 3, 32)}


def model_id(config: dict[str, Any]) -> str:
    """protocol.md "The model id": <model>/<num_classes>/<in_channels>x<image_size>/<base><linear_kp>."""
    classes, channels, size = DATASETS[config["dataset"]]
    kp = config["kp"] if config["base"] == "linear" else 0
    return f"{config['model']}/{classes}/{channels}x{size}/{config['base']}{kp}"


class Models:
    """Downloads and decodes models, each checked against the federation's model id (codec.md D9). The first
    one (the enrolment's ``init_digest``) fixes the tensor names and shapes; every later payload is decoded
    against them (D10; a base or a neighbour's model may hold fewer tensors), within the server's blob size."""

    def __init__(self, srv: Server, config: dict[str, Any]) -> None:
        self.srv = srv
        self.model_id = model_id(config)
        self.shapes: dict[str, tuple[int, ...]] | None = None

    def get(self, digest: str) -> codec.Payload:
        got = codec.decode(self.srv.blob(digest), expected=self.shapes, model_id=self.model_id,
                           max_bytes=MAX_BLOB, allow_missing=True)
        if self.shapes is None:
            self.shapes = {k: a.shape for k, a in got.tensors.items()}
        return got


def erk_densities(shapes: dict[str, tuple[int, ...]], density: float) -> dict[str, float]:
    """docs/algorithms.md "DisPFL": ERK density per tensor for an overall density ``density``."""
    n = {k: int(np.prod(s)) for k, s in shapes.items()}
    raw = {k: (sum(s) / n[k]) if n[k] else 0.0 for k, s in shapes.items()}
    dense: set[str] = set()
    while True:
        sparse = [k for k in shapes if k not in dense]
        denom = sum(raw[k] * n[k] for k in sparse)
        if not sparse or denom == 0:
            return {k: 1.0 for k in shapes}
        eps = (density * sum(n[k] for k in sparse) - (1 - density) * sum(n[k] for k in dense)) / denom
        top = max(raw[k] for k in sparse)
        if top * eps <= 1:
            return {k: 1.0 if k in dense else eps * raw[k] for k in shapes}
        dense |= {k for k in sparse if raw[k] == top}


def erk_mask(shapes: dict[str, tuple[int, ...]], density: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Initial mask: exactly int(density_l * numel) ones per tensor at random positions (bool arrays)."""
    out = {}
    for k, d in erk_densities(shapes, density).items():
        numel = int(np.prod(shapes[k]))
        flat = np.zeros(numel, dtype=bool)
        flat[rng.choice(numel, size=min(numel, int(d * numel)), replace=False)] = True
        out[k] = flat.reshape(shapes[k])
    return out


class FedPer:
    """protocol.md "Rounds, tasks and metrics", FedPer: download the base, train, upload the base part only (here:
    exactly the base's tensors, so a personal block can never leave), then post the metrics of round t - 1 if it
    trained then; at the final task (round T) post the metrics of round T."""

    def __init__(self, srv: Server, enr: dict[str, Any], args: argparse.Namespace) -> None:
        self.srv, self.enr, self.args = srv, enr, args
        self.models = Models(srv, enr["config"])
        self.trained: int | None = None  # the round it last trained in
        self.loss = 0.0

    def start(self) -> None:
        self.models.get(self.enr["init_digest"])

    def handle(self, task: dict[str, Any]) -> None:
        t = int(task["round"])
        base = self.models.get(task["base"])
        if task.get("final"):  # round T: no training, no update; evaluate on the last average, report round T
            report(self.srv, t, self.loss)
            return
        new = {k: (a + np.float32(self.args.delta)).astype(np.float32) for k, a in base.tensors.items()}
        self.loss = float(np.mean([np.abs(new[k] - base.tensors[k]).mean() for k in new]))
        payload = codec.encode(new, model_id=base.model_id, round=t)
        save(self.args, t, payload, new, {})
        accepted = self.srv.upload(payload, t, self.args.n_samples, self.loss)
        if accepted and self.trained is not None:  # metrics of round t - 1, after the update was accepted
            report(self.srv, self.trained, self.loss)
        self.trained = t


class DisPFL:
    """protocol.md "Rounds, tasks and metrics" and "Local training", DisPFL: round 0 uploads the initial sparse
    model; round t averages the in-neighbours' latest models with its own, each counted where the mask that
    travels with it covers a coordinate, applies its own mask, trains, uploads the trained weights with the mask
    they were trained under, and once that update is accepted posts the metrics of round t."""

    def __init__(self, srv: Server, enr: dict[str, Any], args: argparse.Namespace) -> None:
        self.srv, self.enr, self.args = srv, enr, args
        self.w: dict[str, np.ndarray] = {}
        self.mask: dict[str, np.ndarray] = {}
        self.models = Models(srv, enr["config"])

    def start(self) -> None:
        init = self.models.get(self.enr["init_digest"])
        shapes = {k: a.shape for k, a in init.tensors.items()}
        self.mask = erk_mask(shapes, float(self.enr["density"]), np.random.default_rng(self.args.seed))
        self.w = {k: (a * self.mask[k]).astype(np.float32) for k, a in init.tensors.items()}
        self.send(0, 0.0)

    def send(self, t: int, loss: float) -> bool:
        payload = codec.encode(self.w, model_id=self.models.model_id, round=t, masks=self.mask)
        save(self.args, t, payload, self.w, self.mask)
        return self.srv.upload(payload, t, self.args.n_samples, loss)

    def handle(self, task: dict[str, Any]) -> None:
        t = int(task["round"])
        if t == 0 or task.get("final"):
            return
        total = {k: self.w[k].astype(np.float64) * self.mask[k] for k in self.w}
        count = {k: self.mask[k].astype(np.int64) for k in self.w}
        for nb in task.get("neighbours", []):
            got = self.models.get(nb["digest"])
            log.info("round %d: neighbour slot %d, %s", t, nb["index"], nb["digest"][:12])
            for k, a in got.tensors.items():
                m = got.masks.get(k, np.ones(a.shape, dtype=bool))  # a tensor sent without a mask is dense
                total[k] += np.where(m, a, 0.0)
                count[k] += m
        avg = {k: np.where(count[k] > 0, total[k] / np.maximum(count[k], 1), 0.0) for k in total}
        before = {k: (avg[k] * self.mask[k]).astype(np.float32) for k in avg}
        self.w = {k: ((before[k] + np.float32(self.args.delta)) * self.mask[k]).astype(np.float32) for k in before}
        loss = float(np.mean([np.abs(self.w[k] - before[k]).mean() for k in self.w]))
        if self.send(t, loss):  # metrics of round t, after its update was accepted
            report(self.srv, t, loss)


def report(srv: Server, t: int, loss: float) -> None:
    """POST /v1/rounds/{t}/metrics. It has no test data: n_test 0, accuracy 0, loss as the module docs say."""
    body = {"accuracy": 0.0, "loss": loss, "n_test": 0, "bytes_down": srv.bytes_down}
    r = srv.call("POST", f"{API}/rounds/{t}/metrics", json=body)
    if r.status_code != 200:  # 409: a round it may not report (any more); nothing to redo
        log.warning("round %d: metrics refused: %s %s", t, r.status_code, r.text[:200])
        return
    log.info("round %d: metrics sent", t)


def save(args: argparse.Namespace, t: int, payload: bytes, w: dict[str, np.ndarray],
         masks: dict[str, np.ndarray]) -> None:
    """What it sent in round t, for whoever checks it: the payload and the values and masks it encoded."""
    d = Path(args.state_dir)
    (d / f"upload-{t}.bin").write_bytes(payload)
    arrays: dict[str, Any] = {**{f"w:{k}": a for k, a in w.items()}, **{f"m:{k}": a for k, a in masks.items()}}
    np.savez(d / f"sent-{t}.npz", **arrays)


def finished(srv: Server, fed: str) -> bool:
    return bool(srv.ok("GET", f"{API}/federations/{fed}")["state"] == "finished")


def current_task(srv: Server) -> dict[str, Any] | None:
    r = srv.call("GET", f"{API}/rounds/current/task")
    if r.status_code == 404:
        return None
    if r.status_code != 200:
        raise RuntimeError(f"task: {r.status_code} {r.text[:200]}")
    return dict(r.json())


def run(args: argparse.Namespace) -> None:
    Path(args.state_dir).mkdir(parents=True, exist_ok=True)
    srv = Server(args.server, args.patience)
    enr = enrol(srv, args)
    srv.token = enr["token"]
    bell = Doorbell(enr) if args.mqtt else None
    if bell is not None and not bell.connected.wait(60):  # the doorbell first, then the polls (bounded: the
        log.warning("mqtt: not connected after 60 s; polling without the doorbell")  # polls work without it)
    device = DisPFL(srv, enr, args) if enr["config"]["algorithm"] == "dispfl" else FedPer(srv, enr, args)
    device.start()
    done = -1
    try:
        while True:
            # "finished" is read before the task: once it is true, the final task (if any) is already there
            fin = finished(srv, enr["federation"])
            task = current_task(srv)
            if task is not None and (task["round"], bool(task.get("final"))) > (done, False):
                log.info("task: round %d%s", task["round"], " (final)" if task.get("final") else "")
                name = f"task-{task['round']}{'-final' if task.get('final') else ''}.json"
                (Path(args.state_dir) / name).write_text(json.dumps(task))
                try:
                    device.handle(task)
                except codec.CodecError as e:  # a model that does not decode: log it, sit this round out
                    log.error("round %d: %s", task["round"], e)
                done = task["round"] if not task.get("final") else 10**9
                if bell is not None:
                    bell.done = done
                continue
            if fin:
                log.info("the federation is finished")
                return
            if bell is not None:
                bell.wait(args.poll)
            else:
                time.sleep(args.poll)
    finally:
        if bell is not None:
            bell.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True)
    p.add_argument("--federation", required=True)
    p.add_argument("--enrol-secret", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--index", type=int, default=None, help="the slot (data partition) it asks for")
    p.add_argument("--profile", default="phone-mid", help="a profile name the server knows (device_profiles/)")
    p.add_argument("--name", default="spec-device")
    p.add_argument("--n-samples", type=int, default=40, help="declared at enrolment and sent with every update")
    p.add_argument("--delta", type=float, default=0.01, help="what its training adds to every trained weight")
    p.add_argument("--seed", type=int, default=0, help="the seed of its DisPFL mask")
    p.add_argument("--poll", type=float, default=0.3, help="seconds between task polls")
    p.add_argument("--patience", type=float, default=120.0, help="seconds of HTTP retries before giving up")
    p.add_argument("--no-mqtt", dest="mqtt", action="store_false", help="poll only, no doorbell")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s spec-device %(message)s", stream=sys.stdout)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the protocol's steps
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
