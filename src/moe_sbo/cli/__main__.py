"""``python -m moe_sbo.cli``: the same as the ``moe-sbo`` command."""

import sys

from .main import main

sys.exit(main())
