"""The test suite. Importing it is an entry point (pytest's process and every worker a test
spawns import it first): the ``RELAYMOE_*`` environment becomes the process's options, once."""

from relaymoe import options

options.install(options.from_env())
