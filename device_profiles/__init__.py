"""Device classes and fleets as data files (``profiles/*.toml``, ``fleets/*.toml``), a typed registry, and
``check``: does a model fit a class at its density."""

from .check import Fit, check
from .registry import (
    AVAILABILITY,
    Emulation,
    Fleet,
    FleetMember,
    Profile,
    get_fleet,
    get_profile,
    list_fleets,
    list_profiles,
    load_dir,
    register_fleet,
    register_profile,
)

__all__ = [
    "AVAILABILITY",
    "Emulation",
    "Fit",
    "Fleet",
    "FleetMember",
    "Profile",
    "check",
    "get_fleet",
    "get_profile",
    "list_fleets",
    "list_profiles",
    "load_dir",
    "register_fleet",
    "register_profile",
]
