"""How a device agent is configured (``pfl-edge client``'s flags)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pfl_edge.errors import ConfigError

__all__ = ["AgentConfig"]


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
    # heard nothing from the broker this long, it asks the server for its task (a lost bell): one request per
    # device per minute, a server's load to size for at fleet scale
    ask_every_s: float = 60.0
    ca_file: str | None = None  # the CA that signed the server's certificate (https://; MQTT over TLS too)
    max_blob_bytes: int = 256 * 1024 * 1024
    exit_when_done: bool = True
    training_backend: str | None = None  # torch | executorch; None: the profile's
    training_program: str | None = None  # an exported ExecuTorch training program (else the server's)
    # how its registered data set is dealt (dataset, partition, clients, seed), where it differs from the config
    data_overrides: dict[str, Any] = field(default_factory=dict)
    # what its models are held as: torch tensors, or numpy arrays (a device without torch: the ExecuTorch program
    # trains, the server's ONNX program evaluates); auto: torch where it is installed
    arrays: Literal["auto", "torch", "numpy"] = "auto"

    def __post_init__(self) -> None:
        if not self.server.startswith(("http://", "https://")):
            raise ConfigError(f"--server must be an http(s) URL, got {self.server!r}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.patience_s <= 0:
            raise ConfigError("patience must be > 0 seconds")
        if not self.ask_every_s > 0:
            raise ConfigError(f"ask_every_s must be > 0 seconds, got {self.ask_every_s!r}")
        if self.arrays not in ("auto", "torch", "numpy"):
            raise ConfigError(f"arrays must be auto, torch or numpy, got {self.arrays!r}")
