"""Former home of the coordinator, kept so that existing imports (``from server.rounds import Coordinator``)
still work. The round state machine is ``server.states`` (the table) and ``server.services.rounds`` (the
transitions); the coordinator is ``server.coordinator``."""

from .coordinator import Coordinator
from .errors import ApiError

__all__ = ["ApiError", "Coordinator"]
