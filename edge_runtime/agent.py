"""The device agent, ``pfl-edge client``: enrols once, follows rounds over MQTT, moves weights over HTTP,
trains on its own data, and keeps its personal blocks (FedPer) or its mask (DisPFL) to itself.

The agent is the loop only: a round is its algorithm's ``device_round``, the code the simulator runs for the
slot. Every step is recomputable from the state dir (seeds derive from the federation's seed, the round and the
slot), so a device killed mid-round redoes it alike; a trained round's payload is kept until the server accepted
it, and the server treats a repeated update as the same one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from device_profiles import get_profile
from pfl_edge.algorithms import Algorithm, Upload, get_algorithm
from pfl_edge.codec import encode
from pfl_edge.errors import CodecError, ConfigError, DivergedError
from pfl_edge.federation import FederationConfig, check_device_config, model_id
from pfl_edge.protocol import (
    API_PREFIX,
    COSTS_SINCE,
    Enrolment,
    RoundAnnouncement,
    Task,
    UpdateRequest,
    round_topic,
    task_topic,
)

from .arrays_kind import array_kind, initial_model, open_model
from .config import AgentConfig
from .control import Control
from .data import device_data
from .enrol import enrol, renew
from .http import Http, ServerError, ServerUnavailable
from .programs import ProgramSource
from .reports import post_metrics, usable_metrics
from .secure import send_securely
from .state import Progress, StateDir
from .tasks import Downloads, TaskSource, UnusableModel, all_finite, mismatch
from .trainer import DeviceTrainer, device_clients
from .training import BackendRequest, TrainingBackend, device_backend, get_training_backend
from .whoami import describe

__all__ = ["Agent", "AgentConfig", "ServerError", "ServerUnavailable", "install_signal_handlers"]

log = logging.getLogger("pfl_edge.client")


class Agent:
    """One device. ``run()`` returns when the federation has finished (or ``stop()`` is called)."""

    def __init__(self, cfg: AgentConfig, *, on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.profile = get_profile(cfg.profile)
        self.arrays = array_kind(cfg.arrays)
        backend = device_backend(self.arrays, cfg.training_backend, self.profile.training_backend)  # refuses torch
        self.platform = describe(backend, cfg.threads or self.profile.threads)  # said at enrolment
        self.store = StateDir(cfg.state_dir, arrays=self.arrays)
        self.http = Http(cfg.server, cfg.patience_s, ca_file=cfg.ca_file)
        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.on_event = on_event or (lambda kind, data: None)
        self._stop = threading.Event()
        self.http.stop = self._stop  # from the start: a stop while it enrols or fetches ends its retries too
        self.done = False
        self._skipped: set[int] = set()  # rounds sat out in this run (a bad model received, diverged training)
        self._started: dict[int, float] = {}  # a round's start (its task taken up), for its wall time

    # ------------------------------------------------------------------------------------------------ setup
    def enrol(self) -> Enrolment:
        return enrol(self.store, self.http, self.cfg, self.platform)

    def _setup(self) -> None:
        enr = self.enrol()
        self.enr = enr
        self.http.use_token(self.store.root / "token.json", enr.token)  # or the one it rotated to since
        try:
            self.fed = FederationConfig.from_dict(dict(enr.config))
            data_cfg = self.fed.replace(**self.cfg.data_overrides)
        except TypeError as e:
            raise ConfigError(f"the federation's config does not fit this client: {e}") from e
        check_device_config(self.fed)
        self.tasks = TaskSource(self.http, enr.federation)
        threads = self.cfg.threads or self.profile.threads
        if self.arrays == "torch":
            import torch

            torch.set_num_threads(threads)
        self.data = device_data(self.cfg, self.fed, data_cfg, enr.index, self.arrays)
        # training programs, and the card a device without torch takes its model's skeleton from, come from the
        # server's model card, downloaded and checked (docs/model.md)
        backend = self.backend = device_backend(self.arrays, self.cfg.training_backend, self.profile.training_backend)
        self.programs = ProgramSource(self.http, self.enr.federation, self.store.root / "programs",
                                      model_id=model_id(self.data.spec), max_bytes=self.cfg.max_blob_bytes,
                                      training_backend=None if backend == self.profile.training_backend else backend)
        self.model, evaluate = open_model(self.data, self.programs, threads, self.cfg.max_blob_bytes)
        shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        self.downloads = Downloads(self.http, enr.device_id, shapes, model_id(self.data.spec),
                                   self.cfg.max_blob_bytes, arrays=self.arrays)
        self.algo: Algorithm = get_algorithm(self.fed, self.model, enr.kp)
        self.trainer = DeviceTrainer(self.data, self._training_backend(), evaluate)
        self.dev = device_clients(self.fed, self.trainer, enr.index, self.model)
        if self.store.load_tensors("model.safetensors") is None:
            self._init_model(enr)
        prog = self.store.progress
        if self.algo.participation(1).after_initial and not prog.initial_sent:
            # its initial model is what its first neighbours receive (a late joiner's too: the server gives it
            # tasks once it has one); rebuilt from the saved state if a restart came in between
            state, _, _ = self.store.load_model()
            self._stage_upload(prog, 0, self.algo.device_upload(state))
            self._flush_upload()
            prog = self.store.progress
            prog.initial_sent = True
            self.store.save_progress(prog)
        else:
            self._flush_upload()  # a trained round whose upload a restart interrupted

    def _training_backend(self) -> TrainingBackend:
        """The device's training backend (``device_backend``), from the one registry of backends."""
        name = self.backend
        log.info("training with the %s backend on %d thread(s)", name, self.cfg.threads or self.profile.threads)
        return get_training_backend(name).for_device(BackendRequest(
            self.model, self.data.spec, self.profile, self.algo.training_program(), self.fed.batch_size,
            self.cfg.training_program, self.programs.training, threads=self.cfg.threads or self.profile.threads))

    def _init_model(self, enr: Enrolment) -> None:
        init = initial_model(self.arrays, self.fed, self.data, self.downloads, enr)
        if set(init) != set(self.model.state_dict()):
            raise ConfigError("the federation's initial model does not match this device's model")
        prog = self.store.progress
        prog.late = enr.round > 0
        self.store.save_progress(prog)
        self.store.save_model(self.algo.device_init(self.dev, init, enr.density), 0, [])

    # ------------------------------------------------------------------------------------------------ main loop
    def run(self) -> int:
        self._setup()
        ctl = Control(self.enr, self.inbox, ca_file=self.cfg.ca_file, http=self.http)
        try:
            self._renewing(self._wake)  # the server's task now: a retained message may never come
            heard = time.monotonic()
            while not self._stop.is_set() and not self.done:
                self.http.rotate_if_due()  # long before the token expires
                if self.http.chain_ended:
                    self._renew()
                try:
                    batch = [self.inbox.get(timeout=0.5)]
                except queue.Empty:  # a bell lost to the broker (a link renewed mid-publish) must not strand it:
                    if time.monotonic() - heard >= self.cfg.ask_every_s:  # quiet this long, it asks the server
                        self.inbox.put((round_topic(self.enr.federation), b""))
                        heard = time.monotonic()
                    continue
                heard = time.monotonic()
                while True:  # a device back from an absence acts on its current task, not every one it missed
                    try:
                        batch.append(self.inbox.get_nowait())
                    except queue.Empty:
                        break
                self._renewing(functools.partial(self._handle, batch))
        finally:
            ctl.close()
            self.http.client.close()
        return 0

    def stop(self) -> None:
        self._stop.set()

    def _renewing(self, step: Callable[[], None]) -> None:
        """``step``, and once more after enrolling again if the server refused the token (401: expired, or past
        the server's absolute lifetime)."""
        try:
            step()
        except ServerError as e:
            if e.status != 401:
                raise
            log.warning("%s: the device enrols again", e)
            self._renew()
            step()

    def _renew(self) -> None:
        self.enr = renew(self.store, self.http, self.cfg, self.enr, self.platform)

    def _handle(self, batch: list[tuple[str, bytes]]) -> None:
        """MQTT rings the bell (``edge_runtime.tasks``): a task or round message of ours (not a round we are not
        drawn in) makes the device ask the server for its task; the broker's task is only compared, to log."""
        mine = (round_topic(self.enr.federation), task_topic(self.enr.federation, self.enr.device_id))
        rang, hint = False, None
        for topic, payload in batch:
            if topic not in mine:
                continue  # some brokers echo other topics of ours (our own status)
            rang = rang or topic == mine[1] or not self._not_drawn(payload)  # a task of ours rings its own topic
            if topic == mine[1]:
                try:
                    hint = Task.model_validate(json.loads(payload))
                except ValueError as e:  # malformed: logged, and the server is asked all the same
                    log.error("ignored a malformed message on %s: %s", topic, e)
        if rang:
            self._wake(hint)

    def _not_drawn(self, payload: bytes) -> bool:
        """A sampled round's bell not drawing this slot (``Algorithm.participation``): not worth a request. An empty
        bell (a reconnect), an unreadable one, the end and every bell of a secret draw (the server's) are asked."""
        try:
            ann = RoundAnnouncement.model_validate_json(payload) if payload else None
        except ValueError:
            return False
        t = None if ann is None or ann.state == "finished" or ann.round < 1 or self.algo.secret_draw() else ann.round
        return t is not None and self.enr.index not in (self.algo.participation(t).slots or {self.enr.index})

    def _wake(self, hint: Task | None = None) -> None:
        """Act on the server's current task (a stale or forged broker message never moves the device); end once
        the server says the federation finished (FedPer: after its final evaluation)."""
        task = self.tasks.current()
        why = None if hint is None else mismatch(hint, task)
        if why is not None:
            # same round, other content: forged (or a server bug); no task now: stale or forged, cannot tell
            log.log(logging.WARNING if task is not None else logging.INFO, "ignoring the broker's task: %s", why)
            self.on_event("task_mismatch", {"round": hint.round if hint else None, "why": why})
        if task is not None:
            self._run_task(task)
        elif self.tasks.finished() and (self.store.progress.final  # its closing step done, or it has none
                                        or self.algo.closing(self.fed.rounds).refusal(self.enr.index,
                                                                                      has_initial=True)):
            self.done = self.cfg.exit_when_done

    def _run_task(self, task: Task) -> None:
        prog = self.store.progress
        if task.final:
            if not prog.final:
                self._final(task, prog)
            self.done = self.cfg.exit_when_done
            return
        if task.round < prog.round or (task.round == prog.round and prog.posted) or task.round in self._skipped:
            return  # done already (a retained task seen again after a restart), or skipped
        self.on_event("task", {"round": task.round})
        try:
            if task.round == prog.round and not prog.posted:
                self._flush_upload()  # trained before a restart: send what was kept
            else:
                self._round(task, prog)
        except (CodecError, DivergedError) as e:
            # a received model with NaN/Inf, or training diverged: never send or keep that; sit this round out
            self._skipped.add(task.round)
            kind = "bad_model" if isinstance(e, UnusableModel) else "diverged"
            log.error("round %d: skipped (%s): %s", task.round, kind, e)
            self.on_event(kind, {"round": task.round, "error": str(e)})

    # ------------------------------------------------------------------------------------------------ rounds
    def _round(self, task: Task, prog: Progress) -> None:
        t = task.round
        state, saved_t, saved_metrics = self.store.load_model()
        if saved_t == t and self.fed.secure_aggregation is not None:  # its keys died with the restart
            self._skipped.add(t)
            log.warning("round %d: restarted during its secure aggregation; it sits the round out", t)
            return
        if saved_t == t:  # trained in round t before a restart, not staged: send that, never train twice
            self._stage_upload(prog, t, self.algo.device_upload(state), metrics=saved_metrics)
            self._flush_upload()
            return
        self._started = {t: time.monotonic()}  # one round in flight: an earlier one skipped or refused is dropped
        received, down = self.downloads.received(task)
        trainer = self.trainer
        trainer.reset_clock()
        # the base received is round t-1's result: what it reports on (a device that rounds did not sample, or that
        # was away, too); a device that has not trained yet has nothing of its own to report
        out = self.algo.device_round(self.dev, state, received, t, prev=t - 1 if prog.round >= 1 else 0,
                                     late=prog.late)
        if not all_finite(out.state):  # kept as it was: the next round starts from the last good model
            raise DivergedError(f"training diverged: NaN/Inf in the model of round {t}; not keeping or sending it")
        if out.dropped:  # a neighbour's model out of bounds (DisPFL's screen): averaged without it
            log.warning("round %d: left out neighbour slot(s) %s: non-finite, or a norm past the bound", t,
                        list(out.dropped))
            self.on_event("dropped", {"round": t, "slots": list(out.dropped)})
        st = prog.stat(t)
        st.bytes_down, st.train_s, st.transfer_s = down, trainer.train_s, self.downloads.fetch_s
        st.step_ms = 1e3 * trainer.train_s / max(out.steps, 1)
        metrics = usable_metrics(out.metrics, self.data.n_test, self.on_event)
        if self.algo.readable(t, self.enr.index):  # neighbours it left out, with the round's metrics (dashboard)
            metrics = [{**m, "dropped": len(out.dropped)} if m["round"] == t else m for m in metrics]
        self.store.save_model(out.state, t, metrics)
        if out.deployed is not None:  # what it deploys after this round
            self.store.save_tensors("final.safetensors", out.deployed, {"round": str(t)})
        if out.upload is None:
            raise ConfigError(f"algorithm {self.algo.name!r} sent nothing for round {t}")
        if self.fed.secure_aggregation is not None and received.base is not None:
            self._send_securely(t, prog, received.base, out.upload, metrics, out.train_loss, trainer.train_s)
            return
        self._stage_upload(prog, t, out.upload, metrics=metrics, train_loss=out.train_loss, train_s=trainer.train_s)
        self._flush_upload()

    def _send_securely(self, t: int, prog: Progress, base: Any, up: Upload, metrics: list[dict[str, Any]],
                       loss: float | None, train_s: float) -> None:
        """The update goes only masked, through the round's secure aggregation (``edge_runtime.secure``)."""
        def send(payload: bytes) -> bool:
            self._stage_upload(prog, t, payload, metrics=metrics, train_loss=loss, train_s=train_s)
            self._flush_upload()
            return self.store.progress.abandoned != t
        if not send_securely(self.http, self.fed, self.enr.federation, self.enr.index, t, base, up.tensors, send,
                             self._stop) and self.store.progress.round != t:
            self._skipped.add(t)  # never got to send: the last round's metrics all the same
            for m in metrics:
                self._post_metrics(m, prog)

    def _final(self, task: Task, prog: Progress) -> None:
        """The federation's last step: evaluate on the last shared model and report; nothing to send."""
        state, _, _ = self.store.load_model()
        try:
            received, _ = self.downloads.received(task)
        except CodecError as e:  # nothing to evaluate on; the federation is over all the same
            log.error("final step of round %d: skipped (bad_model): %s", task.round, e)
            self.on_event("bad_model", {"round": task.round, "error": str(e)})
            received = None
        if received is not None:
            out = self.algo.device_round(self.dev, state, received, task.round,
                                         prev=task.round if prog.round >= 1 else 0, late=prog.late, final=True)
            if out.deployed is not None and all_finite(out.deployed):
                self.store.save_tensors("final.safetensors", out.deployed, {"round": str(prog.round)})
            for m in usable_metrics(out.metrics, self.data.n_test, self.on_event):
                self._post_metrics(m, prog)
        prog.final = True
        self.store.save_progress(prog)
        self.on_event("final", {"round": prog.round})
        self.done = self.cfg.exit_when_done

    def _stage_upload(self, prog: Progress, t: int, up: Upload | bytes, *, metrics: list[dict[str, Any]] | None = None,
                      train_loss: float | None = None, train_s: float | None = None) -> None:
        payload = up if isinstance(up, bytes) else encode(up.tensors, model_id=model_id(self.data.spec), round=t,
                                                            masks=up.masks)
        self.store.save_upload(payload)
        prog.round, prog.posted, prog.digest = t, False, hashlib.sha256(payload).hexdigest()
        prog.train_loss, prog.train_s = train_loss, train_s
        prog.pending_metrics = list(metrics or [])
        self.store.save_progress(prog)

    def _flush_upload(self) -> None:
        prog = self.store.progress
        if prog.posted:
            self._post_pending(prog)  # accepted, but its metrics were cut off by a restart
            return
        payload = self.store.load_upload()
        if payload is None or prog.digest is None:
            raise ConfigError("progress says an upload is pending but upload.bin is missing")
        sent = time.monotonic()
        self.http.call("PUT", f"{API_PREFIX}/blobs/{prog.digest}", content=payload)
        put_s = time.monotonic() - sent
        upd = UpdateRequest(digest=prog.digest, n_samples=self.data.n_train, train_loss=prog.train_loss,
                            train_s=prog.train_s, bytes_down=prog.stat(prog.round).bytes_down)
        try:
            self.http.call("POST", f"{API_PREFIX}/rounds/{prog.round}/updates", json_body=upd.model_dump())
        except ServerError as e:
            if e.status not in (409, 422):
                raise
            # the round closed without this update (deadline, quorum), or the server refused it (a bound it
            # failed): nothing to resend; it keeps its model and waits for the next task
            log.log(logging.ERROR if e.status == 422 else logging.WARNING,
                    "round %d goes on without this device's update: %s", prog.round, e)
            self.on_event("update_refused" if e.status == 422 else "round_closed", {"round": prog.round})
            prog.posted, prog.abandoned, prog.pending_metrics = True, prog.round, []
            self.store.save_progress(prog)
            return
        self.store.append_ledger(prog.round, prog.digest, upd.n_samples)
        prog.posted = True
        prog.bytes_up += len(payload)
        st = prog.stat(prog.round)
        st.bytes_up, st.transfer_s = len(payload), (st.transfer_s or 0.0) + put_s
        if prog.round in self._started:  # not across a restart: that round's start is gone
            st.round_s = time.monotonic() - self._started.pop(prog.round)
        self.store.save_progress(prog)
        self.on_event("update", {"round": prog.round, "bytes_up": len(payload)})
        self._post_pending(prog)

    def _post_pending(self, prog: Progress) -> None:
        while prog.pending_metrics:
            self._post_metrics(prog.pending_metrics[0], prog)
            prog.pending_metrics.pop(0)
            self.store.save_progress(prog)

    def _post_metrics(self, m: dict[str, Any], prog: Progress) -> None:
        post_metrics(self.http, m, prog, self.on_event, costs=(self.enr.protocol or 1) >= COSTS_SINCE)


def install_signal_handlers(agent: Agent) -> None:
    """SIGTERM and SIGINT stop the agent between steps; its state dir is always consistent."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop())
