"""``python -m moe_sbo``: the same as the ``moe-sbo`` command."""

import sys

from .cli.main import entry

sys.exit(entry())
