"""``python -m mori`` is the ``mori`` command."""

import sys

from mori.cli import main

sys.exit(main())
