"""The ``pfl-edge`` command. Subcommands import what they need lazily, so ``pfl-edge --help`` stays fast.

One module per subcommand (``simulate``, ``demo``, ``server``, ``client``, ``info`` for check and list, ``export``,
``profile``), each registering its own arguments; ``parser`` puts them together and runs one.
"""

from __future__ import annotations

from .parser import build_parser, main

__all__ = ["build_parser", "main"]
