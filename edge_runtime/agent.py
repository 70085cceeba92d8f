"""The device agent, ``pfl-edge client``: enrols once, follows rounds over MQTT, moves weights over HTTP,
trains on its own data, and keeps its personal blocks (FedPer) or its mask (DisPFL) to itself.

Every step of a round is recomputable from what the state dir holds (the seeds of a round are derived from
the federation's seed, the round and the device's slot), so a device killed mid-round redoes that round and
gets the same result; the payload of a trained round is kept until the server has accepted it, and the
server treats a repeated update as the same one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import queue
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx
import torch
from torch import Tensor

from device_profiles import get_profile
from pfl_edge import local
from pfl_edge.errors import CodecError, ConfigError, PflEdgeError
from pfl_edge.protocol import (
    API_PREFIX,
    Enrolment,
    EnrolRequest,
    MetricsReport,
    RoundAnnouncement,
    Task,
    UpdateRequest,
    round_topic,
    status_topic,
    task_topic,
)
from pfl_edge.sim.config import SimConfig

from .state import StateDir

__all__ = ["Agent", "AgentConfig", "ServerError", "ServerUnavailable"]

_MASK = "mask:"  # prefix of the mask tensors beside the weights in the device's model file

log = logging.getLogger("pfl_edge.client")


class ServerError(PflEdgeError):
    """The server refused a request (a 4xx answer): a user error, shown with the server's reason."""

    exit_code = 6


class ServerUnavailable(PflEdgeError):
    """The server could not be reached within the agent's patience."""

    exit_code = 7


@dataclass(frozen=True)
class AgentConfig:
    server: str
    federation: str
    enrol_secret: str
    profile: str
    state_dir: str
    name: str = ""
    partition_id: int | None = None  # the slot (data partition) it asks for; None: whatever is free
    threads: int | None = None  # None: the profile's thread count
    data_dir: str | None = None  # where the registered data set's files are, if not the default
    image_dir: str | None = None  # the user's own labelled images, one folder per class
    patience_s: float = 300.0  # how long to keep retrying an unreachable server or broker
    max_blob_bytes: int = 256 * 1024 * 1024
    exit_when_done: bool = True
    training_backend: str | None = None  # torch | executorch; None: the profile's
    training_program: str | None = None  # an exported ExecuTorch training program (else exported here, once)
    # how its registered data set is dealt (dataset, partition, clients, seed), where it differs from the config
    data_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.server.startswith(("http://", "https://")):
            raise ConfigError(f"--server must be an http(s) URL, got {self.server!r}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.patience_s <= 0:
            raise ConfigError("patience must be > 0 seconds")


class _Http:
    """JSON and blob calls with retries: connection failures and 5xx answers back off (0.5 s doubling to 10 s)
    until ``patience_s``; a 4xx answer is the caller's error and raises ``ServerError`` at once."""

    def __init__(self, base: str, patience_s: float) -> None:
        self.client = httpx.Client(base_url=base.rstrip("/"), timeout=60.0)
        self.patience_s = patience_s
        self.token: str | None = None
        self.stop = threading.Event()

    def call(self, method: str, path: str, *, json_body: Any = None, content: bytes | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if content is not None:
            headers["Content-Type"] = "application/octet-stream"
        deadline = time.monotonic() + self.patience_s
        delay = 0.5
        while True:
            why: str
            try:
                r = self.client.request(method, path, json=json_body, content=content, headers=headers)
                if r.status_code < 500:
                    if r.status_code >= 400:
                        raise ServerError(f"{method} {path}: {r.status_code} {_detail(r)}")
                    return r
                why = f"{r.status_code} {_detail(r)}"
            except httpx.TransportError as e:
                why = f"{type(e).__name__}: {e}"
            if time.monotonic() + delay > deadline or self.stop.is_set():
                raise ServerUnavailable(f"{method} {path}: server unavailable for {self.patience_s:.0f} s ({why})")
            log.warning("%s %s failed (%s); retrying in %.1f s", method, path, why, delay)
            self.stop.wait(delay)
            delay = min(delay * 2, 10.0)


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail", r.text))
    except (json.JSONDecodeError, AttributeError):
        return r.text[:300]


class _Control:
    """The MQTT side: a persistent session (clean_session False, client id = device id) subscribed at QoS 1 to
    the device's task topic and the federation's round topic; ``online`` on connect, ``offline`` as the last
    will. paho reconnects by itself with back-off (1 s to 30 s) when the broker goes away."""

    def __init__(self, enr: Enrolment, inbox: queue.Queue[tuple[str, bytes]]) -> None:
        import paho.mqtt.client as mqtt

        url = urlparse(enr.broker_url)
        if url.scheme not in ("mqtt", "tcp", ""):
            raise ConfigError(f"unsupported broker URL {enr.broker_url!r}: use mqtt://host:port")
        self.fed, self.dev = enr.federation, enr.device_id
        self.inbox = inbox
        self.connected = threading.Event()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pfl-{enr.device_id}", clean_session=False,
                        protocol=mqtt.MQTTv311)
        if enr.mqtt_username:
            c.username_pw_set(enr.mqtt_username, enr.mqtt_password)
        c.will_set(status_topic(self.fed, self.dev), json.dumps({"device_id": self.dev, "state": "offline"}),
                   qos=1, retain=True)
        c.reconnect_delay_set(min_delay=1, max_delay=30)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        self.client = c
        c.connect_async(url.hostname or "127.0.0.1", url.port or 1883, keepalive=30)
        c.loop_start()

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if getattr(reason, "is_failure", False):
            log.warning("broker refused the connection: %s", reason)
            return
        log.info("connected to the broker")
        # subscribe on every connect: a restarted broker may have lost the persistent session
        client.subscribe([(task_topic(self.fed, self.dev), 1), (round_topic(self.fed), 1)])
        client.publish(status_topic(self.fed, self.dev), json.dumps({"device_id": self.dev, "state": "online"}),
                       qos=1, retain=True)
        self.connected.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        self.connected.clear()
        log.warning("broker connection lost (%s); reconnecting", reason)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        self.inbox.put((msg.topic, bytes(msg.payload)))

    def close(self) -> None:
        info = self.client.publish(status_topic(self.fed, self.dev),
                                   json.dumps({"device_id": self.dev, "state": "offline"}), qos=1, retain=True)
        with contextlib.suppress(RuntimeError, ValueError):  # not connected: the will covers it
            info.wait_for_publish(timeout=2.0)
        self.client.disconnect()
        self.client.loop_stop()


class Agent:
    """One device. ``run()`` returns when the federation has finished (or ``stop()`` is called)."""

    def __init__(self, cfg: AgentConfig, *, on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.profile = get_profile(cfg.profile)
        self.store = StateDir(cfg.state_dir)
        self.http = _Http(cfg.server, cfg.patience_s)
        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.on_event = on_event or (lambda kind, data: None)
        self._stop = threading.Event()
        self.done = False

    # ------------------------------------------------------------------------------------------------ setup
    def enrol(self) -> Enrolment:
        saved = self.store.enrolment
        if saved is not None:
            enr = Enrolment.model_validate(saved)
            if enr.federation != self.cfg.federation:
                raise ConfigError(f"state dir {self.cfg.state_dir} belongs to federation {enr.federation!r}, "
                                  f"not {self.cfg.federation!r}; use another --state-dir")
            return enr
        # the nonce is kept before asking: a retry (here, or after a restart) whose first answer was lost gets
        # this device back instead of enrolling a second one
        pending = self.store.read_json("enrol-nonce.json") or {}
        nonce = pending.get("nonce")
        if not isinstance(nonce, str):
            nonce = secrets.token_hex(16)
            self.store.write_json("enrol-nonce.json", {"nonce": nonce}, private=True)
        req = EnrolRequest(federation=self.cfg.federation, enrol_secret=self.cfg.enrol_secret,
                           profile=self.cfg.profile, name=self.cfg.name, index=self.cfg.partition_id, nonce=nonce)
        r = self.http.call("POST", f"{API_PREFIX}/devices", json_body=req.model_dump())
        enr = Enrolment.model_validate(r.json())
        self.store.save_enrolment(enr.model_dump())
        return enr

    def _setup(self) -> None:
        enr = self.enrol()
        self.enr = enr
        self.http.token = enr.token
        try:
            self.sim = SimConfig.from_dict(dict(enr.config))
            data_cfg = self.sim.replace(**self.cfg.data_overrides)
        except TypeError as e:
            raise ConfigError(f"the federation's config does not fit this client: {e}") from e
        local.check_device_config(self.sim)
        torch.set_num_threads(self.cfg.threads or self.profile.threads)
        if self.cfg.image_dir is not None:
            self.data = local.load_image_folder(self.cfg.image_dir, self.sim, seed=self.sim.seed + enr.index)
        else:
            if self.cfg.partition_id is not None and self.cfg.partition_id != enr.index:
                raise ConfigError(f"asked for partition {self.cfg.partition_id} but the server gave slot {enr.index} "
                                  f"(that partition's slot is taken); pick a free --partition-id or leave it out")
            self.data = local.load_local_data(data_cfg, enr.index, data_dir=self.cfg.data_dir)
        self.split = local.device_split(self.data.model, self.sim, enr.kp)
        self.dispfl = self.sim.algorithm == "dispfl"
        self.backend = self._training_backend()
        if self.store.load_tensors("model.safetensors") is None:
            self._init_model(enr)
        prog = self.store.progress
        if self.dispfl and not prog.get("initial_sent"):
            # its initial sparse model is what its first neighbours receive (a late joiner's too: the server
            # gives it tasks once it has one); rebuilt from the saved model if a restart came in between
            weights, masks, _, _ = self._load_model()
            self._stage_upload(prog, 0, local.dispfl_payload(weights, masks, self.data.spec, 0))
            self._flush_upload()
            prog = self.store.progress
            prog["initial_sent"] = True
            self.store.save_progress(prog)
        else:
            self._flush_upload()  # a trained round whose upload a restart interrupted

    def _training_backend(self) -> local.Backend | None:
        """The profile's training backend (or the one asked for). ``torch``: None, eager PyTorch as the simulator
        trains. ``executorch``: a training program, from ``--training-program`` or exported here once and kept
        in the state dir; each round's weights are swapped into it, never re-exported."""
        name = self.cfg.training_backend or self.profile.training_backend
        if name == "torch":
            return None
        if name != "executorch":
            raise ConfigError(f"unknown training backend {name!r}; valid: executorch, torch")
        from .training import ExecuTorchBackend

        path = self.cfg.training_program
        if path is None:
            from export import lower_executorch_training, package, prepare

            out = self.store.root / "programs"
            mode = "dispfl" if self.dispfl else "fedper"  # fedper's program also trains the head alone (-FT)
            found = sorted(out.glob(f"*-train-{mode}.pte")) if out.exists() else []
            if found:
                path = str(found[0])
            else:
                log.info("exporting an ExecuTorch training program (%s, batch %d)", mode, self.sim.batch_size)
                prep = prepare(self.profile, spec=self.data.spec, seed=self.sim.seed)
                lowered = lower_executorch_training(prep, mode=mode, batch_size=self.sim.batch_size)
                path = str(package(lowered, out).path)
        backend = ExecuTorchBackend.from_file(path)
        if backend.batch_size < self.sim.batch_size:
            raise ConfigError(f"the training program takes batches of {backend.batch_size}, the federation trains "
                              f"with {self.sim.batch_size}: export one at the federation's batch size")
        return backend

    def _init_model(self, enr: Enrolment) -> None:
        # FedPer: the server sends the initial base; the personal blocks start from the federation's seeded
        # initial model, built here (they never travel). DisPFL: the whole dense initial model.
        init = {**local.init_state(self.sim, self.data.spec), **self._fetch_model(enr.init_digest)}
        if set(init) != set(self.data.model.state_dict()):
            raise ConfigError("the federation's initial model does not match this device's model")
        prog = self.store.progress
        prog["late"] = enr.round > 0
        self.store.save_progress(prog)
        if self.dispfl:
            weights, masks = local.dispfl_init(self.data, self.sim, enr.index, enr.density, init)
            self._save_model(weights, masks, 0)
        else:
            self._save_model(init, None, 0)

    # the model, its mask and the round it was trained in live in one file, written atomically: a restart
    # never sees a mask of one round beside weights of another
    def _save_model(self, weights: dict[str, Tensor], masks: dict[str, Tensor] | None, t: int,
                    metrics: dict[str, Any] | None = None) -> None:
        tensors = dict(weights)
        if masks is not None:
            tensors.update({f"{_MASK}{k}": v for k, v in masks.items()})
        self.store.save_tensors("model.safetensors", tensors, {"round": str(t), "metrics": json.dumps(metrics)})

    def _load_model(self) -> tuple[dict[str, Tensor], dict[str, Tensor], int, dict[str, Any] | None]:
        got = self.store.load_tensors_meta("model.safetensors")
        if got is None:
            raise ConfigError(f"{self.cfg.state_dir}/model.safetensors is missing; remove the state dir to enrol "
                              "afresh")
        tensors, meta = got
        weights = {k: v for k, v in tensors.items() if not k.startswith(_MASK)}
        masks = {k.removeprefix(_MASK): v for k, v in tensors.items() if k.startswith(_MASK)}
        return weights, masks, int(meta.get("round", "0")), json.loads(meta.get("metrics", "null"))

    # ------------------------------------------------------------------------------------------------ main loop
    def run(self) -> int:
        self._setup()
        ctl = _Control(self.enr, self.inbox)
        self.http.stop = self._stop
        try:
            while not self._stop.is_set() and not self.done:
                try:
                    batch = [self.inbox.get(timeout=0.5)]
                except queue.Empty:
                    continue
                while True:  # a device back from an absence acts on its current task, not every one it missed
                    try:
                        batch.append(self.inbox.get_nowait())
                    except queue.Empty:
                        break
                task_msgs = [m for m in batch if m[0] == task_topic(self.enr.federation, self.enr.device_id)]
                for topic, payload in [m for m in batch if m not in task_msgs] + task_msgs[-1:]:
                    self._handle(topic, payload)
        finally:
            ctl.close()
            self.http.client.close()
        return 0

    def stop(self) -> None:
        self._stop.set()

    def _handle(self, topic: str, payload: bytes) -> None:
        try:
            msg = json.loads(payload)
            if topic == round_topic(self.enr.federation):
                ann = RoundAnnouncement.model_validate(msg)
                if ann.state == "finished" and (self.dispfl or self.store.progress.get("final")):
                    self.done = self.cfg.exit_when_done
                return
            if topic != task_topic(self.enr.federation, self.enr.device_id):
                return  # some brokers echo other topics of ours (our own status); only tasks are ours to act on
            task = Task.model_validate(msg)
        except ValueError as e:  # a malformed control message: log it, never act on it
            log.error("ignored a malformed message on %s: %s", topic, e)
            return
        # the latest task supersedes older ones still queued (a device that was away gets the current round)
        self._run_task(task)

    def _run_task(self, task: Task) -> None:
        prog = self.store.progress
        if task.final:
            if not prog.get("final") and self._current(task):
                self._fedper_final(task, prog)
            return
        if task.round < prog["round"] or (task.round == prog["round"] and prog["posted"]):
            return  # done already (a retained task seen again after a restart)
        if not self._current(task):
            return
        self.on_event("task", {"round": task.round})
        try:
            if task.round == prog["round"] and not prog["posted"]:
                self._flush_upload()  # trained before a restart: send what was kept
            elif self.dispfl:
                self._dispfl_round(task, prog)
            else:
                self._fedper_round(task, prog)
        except CodecError as e:
            # training diverged (NaN/Inf weights): never send them; sit this round out, try again next round
            log.error("round %d: not sending an update: %s", task.round, e)
            self.on_event("diverged", {"round": task.round, "error": str(e)})

    def _current(self, task: Task) -> bool:
        """Is ``task`` the federation's round now? Asked of the server over HTTP (authenticated), so a stale
        retained message, or one forged on the broker, never makes the device train or move its progress."""
        info = self.http.call("GET", f"{API_PREFIX}/federations/{self.enr.federation}").json()
        if task.final:
            ok = info["state"] in ("published", "finished") and info["round"] == task.round
        else:
            ok = info["round"] == task.round and info["state"] in ("open", "collecting")
        if not ok:
            log.info("ignoring a task of round %d: the federation is in round %s (%s)", task.round, info["round"],
                     info["state"])
        return bool(ok)

    # ------------------------------------------------------------------------------------------------ rounds
    def _fetch(self, digest: str) -> bytes:
        data = self.http.call("GET", f"{API_PREFIX}/blobs/{digest}").content
        if hashlib.sha256(data).hexdigest() != digest:
            raise ServerError(f"blob {digest} arrived with other content (sha256 mismatch); not using it")
        self._down += len(data)
        return data

    def _fetch_model(self, digest: str) -> dict[str, Tensor]:
        self._down = 0
        return local.decode_model(self._fetch(digest), self.data, max_bytes=self.cfg.max_blob_bytes).tensors

    def _stage_upload(self, prog: dict[str, Any], t: int, payload: bytes, **extra: Any) -> None:
        self.store.save_upload(payload)
        prog.update(round=t, posted=False, digest=hashlib.sha256(payload).hexdigest(), **extra)
        self.store.save_progress(prog)

    def _flush_upload(self) -> None:
        prog = self.store.progress
        if prog["posted"]:
            if prog.get("pending_metrics"):  # accepted, but its metrics were cut off by a restart
                self._post_metrics(prog["round"], prog.pop("pending_metrics"))
                self.store.save_progress(prog)
            return
        payload = self.store.load_upload()
        if payload is None:
            raise ConfigError("progress says an upload is pending but upload.bin is missing")
        self.http.call("PUT", f"{API_PREFIX}/blobs/{prog['digest']}", content=payload)
        upd = UpdateRequest(digest=prog["digest"], n_samples=self.data.n_train, train_loss=prog.get("train_loss"),
                            train_s=prog.get("train_s"), bytes_down=prog.get("down", 0))
        try:
            self.http.call("POST", f"{API_PREFIX}/rounds/{prog['round']}/updates", json_body=upd.model_dump())
        except ServerError as e:
            if " 409 " not in str(e):
                raise
            # the round closed without this update (deadline, quorum): nothing to resend; wait for the next task
            log.warning("round %d closed without this device's update: %s", prog["round"], e)
            prog.update(posted=True, abandoned=prog["round"])
            prog.pop("pending_metrics", None)
            self.store.save_progress(prog)
            return
        prog["posted"] = True
        prog["bytes_up"] = prog.get("bytes_up", 0) + len(payload)
        self.store.save_progress(prog)
        if prog.get("pending_metrics"):
            self._post_metrics(prog["round"], prog.pop("pending_metrics"))
            self.store.save_progress(prog)
        self.on_event("update", {"round": prog["round"], "bytes_up": len(payload)})

    def _post_metrics(self, t: int, m: dict[str, Any]) -> None:
        self.http.call("POST", f"{API_PREFIX}/rounds/{t}/metrics", json_body=MetricsReport(**m).model_dump())
        self.on_event("metrics", {"round": t, **m})

    def _fedper_sync(self, task: Task, prog: dict[str, Any]) -> tuple[dict[str, Tensor], int]:
        """The device's model on the task's new base (FedPer-FT: its personal blocks adapted to it), with the
        metrics of the previous round reported."""
        state, _, _, _ = self._load_model()
        self._down = 0
        if task.base is not None:
            base = local.decode_model(self._fetch(task.base), self.data, max_bytes=self.cfg.max_blob_bytes).tensors
            state.update({k: v for k, v in base.items() if k in set(self.split.base)})
        down = self._down
        prev = prog["round"]
        if self.sim.algorithm == "fedper-ft" or (prog.get("late") and prev == 0 and self.split.personal):
            state = local.personal_finetune(self.data, state, self.split, self.sim, prev, self.enr.index,
                                            backend=self.backend)
        if prev >= 1:
            acc, loss = local.evaluate_local(self.data, state)
            self._post_metrics(prev, {"accuracy": acc, "loss": loss, "n_test": self.data.n_test,
                                      "bytes_up": prog.get("last_up", 0), "bytes_down": prog.get("last_down", 0),
                                      "step_ms": prog.get("step_ms"), "train_s": prog.get("train_s")})
        return state, down

    def _fedper_round(self, task: Task, prog: dict[str, Any]) -> None:
        t = task.round
        saved, _, saved_t, _ = self._load_model()
        if saved_t == t:  # trained in round t before a restart, not staged: send that, never train twice
            self._stage_upload(prog, t, local.base_payload(saved, self.split, self.data.spec, t))
            self._flush_upload()
            return
        state, down = self._fedper_sync(task, prog)
        start = time.perf_counter()
        state, loss, steps = local.train_local(self.data, state, self.sim, t, self.enr.index, backend=self.backend)
        train_s = time.perf_counter() - start
        payload = local.base_payload(state, self.split, self.data.spec, t)
        self._save_model(state, None, t)
        self._stage_upload(prog, t, payload, train_loss=loss, train_s=train_s, down=down, last_down=down,
                           last_up=len(payload), step_ms=1e3 * train_s / max(steps, 1))
        self._flush_upload()

    def _fedper_final(self, task: Task, prog: dict[str, Any]) -> None:
        state, _ = self._fedper_sync(task, prog)
        self.store.save_tensors("final.safetensors", state, {"round": str(prog["round"])})
        prog["final"] = True
        self.store.save_progress(prog)
        self.on_event("final", {"round": prog["round"]})
        self.done = self.cfg.exit_when_done

    def _dispfl_round(self, task: Task, prog: dict[str, Any]) -> None:
        t = task.round
        weights, masks, saved_t, saved_metrics = self._load_model()
        if saved_t == t:  # trained in round t before a restart, not staged: send that, never train twice
            self._stage_upload(prog, t, local.dispfl_payload(weights, masks, self.data.spec, t),
                               pending_metrics=saved_metrics)
            self._flush_upload()
            return
        self._down = 0
        others = [(n.index, local.decode_model(self._fetch(n.digest), self.data, max_bytes=self.cfg.max_blob_bytes))
                  for n in task.neighbours if n.device_id != self.enr.device_id]
        down = self._down
        start_state = local.dispfl_average(weights, masks, self.enr.index, others)
        start = time.perf_counter()
        trained, loss, steps = local.train_local(self.data, start_state, self.sim, t, self.enr.index, masks=masks,
                                                 backend=self.backend)
        train_s = time.perf_counter() - start
        acc, test_loss = local.evaluate_local(self.data, trained)
        # what it deploys this round is the trained model (as the simulator evaluates it)
        self.store.save_tensors("final.safetensors", trained, {"round": str(t)})
        weights, masks = local.dispfl_update_mask(self.data, trained, masks, self.sim, t, self.enr.index,
                                                  backend=self.backend)
        payload = local.dispfl_payload(weights, masks, self.data.spec, t)
        metrics = {"accuracy": acc, "loss": test_loss, "n_test": self.data.n_test, "bytes_up": len(payload),
                   "bytes_down": down, "step_ms": 1e3 * train_s / max(steps, 1), "train_s": train_s}
        self._save_model(weights, masks, t, metrics)
        self._stage_upload(prog, t, payload, train_loss=loss, train_s=train_s, down=down, pending_metrics=metrics)
        self._flush_upload()


def install_signal_handlers(agent: Agent) -> None:
    """SIGTERM and SIGINT stop the agent between steps; its state dir is always consistent."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop())
