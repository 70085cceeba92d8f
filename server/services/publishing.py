"""The control plane over MQTT: what the server publishes (retained round announcements and per-device tasks)
and what it hears (devices' online/offline status). Without a link (tests, benchmarks) nothing is published."""

from __future__ import annotations

import logging

from pfl_edge.protocol import DeviceStatus, RoundAnnouncement, Task, round_topic, task_topic

from ..db import Device, Federation, now
from ..mqtt import MqttLink
from .store import Store

__all__ = ["Publisher"]

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, store: Store, link: MqttLink | None) -> None:
        self.store = store
        self.link = link

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
        with self.store.write() as s:
            dev = s.get(Device, dev_id)
            if dev is None or dev.federation != fed_id:
                return
            dev.online = st.state == "online"
            dev.last_seen = now()
