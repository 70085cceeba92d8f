"""The control plane over MQTT: what the server publishes (retained round announcements and per-device tasks)
and what it hears (devices' online/offline status). Without a link (tests, benchmarks) nothing is published.

Statuses are written in batches: the MQTT thread only queues a device's latest status, and a thread of their
own writes whatever is queued every ``STATUS_EVERY_S`` in one transaction (a fleet reconnecting after a broker
restart sends thousands a second; one transaction each fell behind and was dropped at 10,000 devices)."""

from __future__ import annotations

import logging
import threading

from sqlalchemy import bindparam, update

from pfl_edge.protocol import DeviceStatus, RoundAnnouncement, Task, round_topic, task_topic

from ..db import Device, Federation, now
from ..mqtt import MqttLink
from .store import Store

__all__ = ["Publisher"]

log = logging.getLogger(__name__)


STATUS_EVERY_S = 0.2  # how stale a device's online flag may be, at most, beyond the broker's own delay


class Publisher:
    def __init__(self, store: Store, link: MqttLink | None, *, status_every_s: float = STATUS_EVERY_S) -> None:
        self.store = store
        self.link = link
        self.status_every_s = status_every_s
        # (federation, device) as the topic named them -> (online, at): the latest of each
        self._statuses: dict[tuple[str, str], tuple[bool, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.status_writes = 0  # transactions that wrote statuses (benchmarks, tests)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pfl-statuses", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        self.flush_statuses()

    def _run(self) -> None:
        while not self._stop.wait(self.status_every_s):
            try:
                self.flush_statuses()
            except Exception:  # the database away for a moment: the statuses stay queued for the next try
                log.exception("writing device statuses")

    def flush_statuses(self) -> int:
        """Write every queued status in one transaction (each device's latest; a device of another federation
        than its topic named is left alone); how many were queued."""
        with self._lock:
            batch, self._statuses = self._statuses, {}
        if not batch:
            return 0
        rows = [{"d": dev, "f": fed, "o": online, "t": at} for (fed, dev), (online, at) in batch.items()]
        try:
            with self.store.write() as s:
                s.connection().execute(  # core executemany: one statement, every row
                    update(Device).where(Device.id == bindparam("d"), Device.federation == bindparam("f"))
                    .values(online=bindparam("o"), last_seen=bindparam("t")), rows)
        except Exception:
            with self._lock:  # back in the queue, unless a newer status came meanwhile
                for key, v in batch.items():
                    self._statuses.setdefault(key, v)
            raise
        self.status_writes += 1
        return len(rows)

    def publish(self, topic: str, msg: Task | RoundAnnouncement) -> None:
        if self.link is not None:
            self.link.publish(topic, msg)

    def tasks(self, fed_id: str, tasks: list[tuple[str, Task]]) -> None:
        for dev_id, task in tasks:
            self.publish(task_topic(fed_id, dev_id), task)

    def announce(self, fed_id: str) -> None:
        """The federation's round and state as they are now (retained: a device that connects later sees it)."""
        with self.store.read() as s:
            fed = s.get(Federation, fed_id)
            if fed is None:
                return
            base = self.store.model(fed).algorithm().shared_digest(fed.base_digest)  # a server's average only
            msg = RoundAnnouncement(federation=fed_id, round=fed.round, state=fed.state,  # type: ignore[arg-type]
                                    base=base, deadline=fed.round_deadline)
        self.publish(round_topic(fed_id), msg)

    def on_status(self, topic: str, payload: bytes) -> None:
        """From the MQTT thread: a device's retained status (``pfl/<fed>/device/<dev>/status``) changed."""
        parts = topic.split("/")
        if len(parts) != 5 or not payload:
            return  # a cleared retained message, or not ours
        fed_id, dev_id = parts[1], parts[3]
        try:
            st = DeviceStatus.model_validate_json(payload)
        except ValueError:
            log.warning("malformed status on %s", topic)
            return
        if st.device_id != dev_id:
            return
        with self._lock:
            self._statuses[fed_id, dev_id] = (st.state == "online", now())
        if self._thread is None:  # not started (tests driving the services by hand): written at once
            self.flush_statuses()
