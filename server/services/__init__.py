"""The coordinator's services, each small and on its own: the shared store, blob access, enrolment (and
federations), updates, metrics, MQTT publishing and device status, the round machine and its worker, and
recovery. ``server.coordinator.Coordinator`` wires them together for the app."""

from .blob_access import BlobAccess
from .enrolment import EnrolmentService
from .metrics import Metrics
from .planning import Planner
from .publishing import Publisher
from .recovery import Recovery
from .rounds import RoundMachine
from .store import Store
from .updates import Updates
from .worker import RoundWorker

__all__ = [
    "BlobAccess",
    "EnrolmentService",
    "Metrics",
    "Planner",
    "Publisher",
    "Recovery",
    "RoundMachine",
    "RoundWorker",
    "Store",
    "Updates",
]
