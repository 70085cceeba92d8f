"""The coordinator: the server's services (``server.services``) wired together once, for the app and the
launchers. It holds no logic of its own: each call goes to the service that owns it."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from .blobs import BlobStore
from .broker import EmbeddedBroker
from .enrol_gate import EnrolGate
from .mqtt import MqttLink
from .services import (
    BlobAccess,
    EnrolmentService,
    Metrics,
    Planner,
    Publisher,
    Recovery,
    RoundMachine,
    RoundWorker,
    Store,
    Updates,
)
from .services.broker_access import BrokerAccess, Mode
from .services.broker_tokens import BrokerTokens
from .services.gc import BlobGC
from .services.leadership import Leadership
from .services.partials import Partials

__all__ = ["Coordinator"]


class Coordinator:
    def __init__(self, sessions: sessionmaker[Session], blobs: BlobStore, link: MqttLink | None, *,
                 device_broker_url: str, device_mqtt_password: str = "", max_blob_bytes: int = 64 << 20,
                 tick_s: float = 1.0, token_ttl_s: float = 30 * 86400.0, gate: EnrolGate | None = None,
                 upload_quota: int = 4, gc_keep_rounds: int = 2, broker_mode: Mode = "shared",
                 embedded_broker: EmbeddedBroker | None = None, server_mqtt: tuple[str, str] = ("", ""),
                 leadership: Leadership | None = None, partial_sums: bool = False,
                 partial_flush_s: float = 1.0, broker_tokens: BrokerTokens | None = None) -> None:
        self.blobs = blobs
        self.store = Store(sessions, max_blob_bytes)
        self.blob_access = BlobAccess(self.store, blobs)
        self.blob_access.upload_quota = upload_quota
        self.publisher = Publisher(self.store, link)
        self.planner = Planner(self.store, self.blob_access)
        self.rounds = RoundMachine(self.store, self.blob_access, self.planner, self.publisher)
        self.recovery = Recovery(self.store, self.planner, self.publisher, self.rounds)
        self.worker = RoundWorker(self.store, self.rounds, self.recovery, tick_s=tick_s, leadership=leadership)
        self.updates = Updates(self.store, self.blob_access, on_accepted=self.worker.kick)
        self.secure = self.rounds.secure  # secure aggregation's steps (server.services.secure)
        self.secure.on_message = self.worker.kick
        self.updates.secure = self.secure
        self.metrics = Metrics(self.store)
        self.enrolment = EnrolmentService(self.store, self.blob_access, device_broker_url=device_broker_url,
                                          device_mqtt_password=device_mqtt_password, on_enrolled=self.worker.kick,
                                          on_created=self.publisher.announce, token_ttl_s=token_ttl_s, gate=gate,
                                          on_revoked=self._revoked)
        # who may use the broker: per-device credentials and topics (server.services.broker_access)
        self.broker_access = BrokerAccess(self.store, broker_mode, server_username=server_mqtt[0],
                                          server_password=server_mqtt[1], broker=embedded_broker, link=link,
                                          shared_password=device_mqtt_password, tokens=broker_tokens)
        self.enrolment.mqtt_password = self.broker_access.fresh_password
        if broker_mode == "jwt":  # the password a device is told is a fresh token (its hash kept as today)
            self.enrolment.mqtt_token = self.broker_access.device_token
        self.enrolment.provision = self.broker_access.provision
        # each accepted update folded into this process's partial sum, merged by the leader at close
        self.partials = Partials(self.store, self.blob_access, flush_s=partial_flush_s) if partial_sums else None
        if self.partials is not None:
            self.updates.on_stored = self.partials.accepted
            self.rounds.partial_sums = True
        self.gc = BlobGC(self.store, self.blob_access, blobs, keep_rounds=gc_keep_rounds)
        self.worker.after_step = self.gc.after_step

    def _revoked(self, dev_id: str) -> None:
        """A revoked device loses its broker access at once (where the broker provisioning offers it)."""
        remove = getattr(getattr(self, "broker_access", None), "remove_device", None)
        if callable(remove):
            remove(dev_id)

    def start(self) -> None:
        self.publisher.start()
        self.worker.start()
        if self.partials is not None:
            self.partials.start()

    def stop(self) -> None:
        if self.partials is not None:
            self.partials.stop()
        self.worker.stop()
        self.publisher.stop()

    def on_status(self, topic: str, payload: bytes) -> None:
        self.publisher.on_status(topic, payload)

    def request_republish(self) -> None:
        self.worker.request_republish()
