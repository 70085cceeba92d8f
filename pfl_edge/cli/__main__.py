"""``python -m pfl_edge.cli``, the same as ``pfl-edge`` (and ``python -m pfl_edge``)."""

import sys

from .parser import main

sys.exit(main())
