"""``python -m relaymoe``: the ``relaymoe`` command line (``relaymoe.cli.main``)."""

import sys

from relaymoe.cli import main

sys.exit(main())
