"""What a device says it is (``Platform``, in its ``EnrolRequest``): a message of the protocol, kept beside
``pfl_edge.protocol`` (which is full) and re-exported there."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Platform"]

_LABEL = r"^[\x20-\x7e]{1,64}$"  # printable ASCII, no control characters: shown as is in tables and logs


class Platform(BaseModel):
    """What a device says it is, at enrolment: its machine architecture, OS, language runtime, training runtime
    and thread count. Reported by the device and never verified: the server shows it beside the declared profile
    and flags a mismatch (an x86_64 machine enrolled as a Raspberry Pi), but decides nothing from it."""

    # as every protocol message: unknown fields refused, NaN/Inf refused
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    machine: str = Field(pattern=r"^[A-Za-z0-9_.+-]{1,32}$", description=(
        "CPU architecture as the OS names it (Python's platform.machine(), Node's process.arch): aarch64, "
        "arm64, x86_64, x64, armv7l"))
    os: str = Field(pattern=_LABEL, description="OS name and release, e.g. 'Linux 6.6.51+rpt-rpi-v8'")
    language: str = Field(pattern=_LABEL, description="the interpreter and its version, e.g. 'python 3.11.2', "
                                                       "'node 20.19.2'")
    runtime: str = Field(pattern=_LABEL, description="the training runtime and its version, e.g. "
                                                      "'onnxruntime 1.22.1', 'torch 2.13.0', 'executorch 1.0.0'")
    threads: int = Field(ge=1, le=1024, strict=True, description="threads it trains with")
    cpus: int | None = Field(default=None, ge=1, le=4096, strict=True, description="CPUs its OS reports")
