"""The MQTT side of the protocol's names: the topics of a federation and a device, a device's default client id,
and the quorum rule that counts a round's updates. Re-exported by ``pfl_edge.protocol``, where every message is."""

from __future__ import annotations

import math

__all__ = ["mqtt_client_id", "quorum_updates", "round_topic", "status_topic", "task_topic"]


def round_topic(fed: str) -> str:
    return f"pfl/{fed}/round"


def task_topic(fed: str, device: str) -> str:
    return f"pfl/{fed}/device/{device}/task"


def status_topic(fed: str, device: str) -> str:
    return f"pfl/{fed}/device/{device}/status"


def quorum_updates(quorum: float, active: int) -> int:
    """How many updates close a round early: the fraction ``quorum`` of the ``active`` devices given its task,
    rounded up, at most all of them (the server's rule; reports and the dashboard count with it too)."""
    return min(active, math.ceil(quorum * active - 1e-9))


def mqtt_client_id(device: str) -> str:
    """A device's MQTT client id where its enrolment names none (``Enrolment.mqtt_client_id``): ``pfl-<id>``."""
    return f"pfl-{device}"
