import sys

from relaymoe.cli import main

sys.exit(main())
