"""The coordinator: the server's services (``server.services``) wired together once, for the app and the
launchers. It holds no logic of its own: each call goes to the service that owns it."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from .blobs import BlobStore
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

__all__ = ["Coordinator"]


class Coordinator:
    def __init__(self, sessions: sessionmaker[Session], blobs: BlobStore, link: MqttLink | None, *,
                 device_broker_url: str, device_mqtt_password: str = "", max_blob_bytes: int = 64 << 20,
                 tick_s: float = 1.0) -> None:
        self.blobs = blobs
        self.store = Store(sessions, max_blob_bytes)
        self.blob_access = BlobAccess(self.store, blobs)
        self.publisher = Publisher(self.store, link)
        self.planner = Planner(self.store, self.blob_access)
        self.rounds = RoundMachine(self.store, self.blob_access, self.planner, self.publisher)
        self.recovery = Recovery(self.store, self.planner, self.publisher, self.rounds)
        self.worker = RoundWorker(self.store, self.rounds, self.recovery, tick_s=tick_s)
        self.updates = Updates(self.store, self.blob_access, on_accepted=self.worker.kick)
        self.metrics = Metrics(self.store)
        self.enrolment = EnrolmentService(self.store, self.blob_access, device_broker_url=device_broker_url,
                                          device_mqtt_password=device_mqtt_password, on_enrolled=self.worker.kick,
                                          on_created=self.publisher.announce)

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()

    def on_status(self, topic: str, payload: bytes) -> None:
        self.publisher.on_status(topic, payload)

    def request_republish(self) -> None:
        self.worker.request_republish()
