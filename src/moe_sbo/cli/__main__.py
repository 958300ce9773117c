"""``python -m moe_sbo.cli``: the same as the ``moe-sbo`` command."""

import sys

from .main import entry

sys.exit(entry())
