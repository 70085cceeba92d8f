"""What Python 3.11 added that a device on Python 3.10 (JetPack 6's Ubuntu 22.04) needs, in one place: the device
path (``edge_runtime``, ``device_profiles`` and the parts of ``pfl_edge`` they import) runs on 3.10; the server, the
simulator and the export run on 3.11+."""

from __future__ import annotations

import sys
from enum import Enum
from typing import Any

__all__ = ["StrEnum", "tomllib"]

if sys.version_info >= (3, 11):
    from enum import StrEnum

    import tomllib
else:  # pragma: no cover - exercised by the Python 3.10 device test
    import tomli as tomllib  # the same API, on PyPI (the bundle pins it for Python < 3.11)

    class StrEnum(str, Enum):
        """enum.StrEnum of 3.11: members are their values as strings (str(), format())."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: Any) -> str:
            return str(self.value).__format__(spec)
