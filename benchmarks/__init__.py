"""The harnesses. Importing the package is an entry point (each benchmark's process and the
workers it spawns import it first): the ``RELAYMOE_*`` environment becomes the process's options,
once (``relaymoe.options.from_env``)."""

from relaymoe import options

options.install(options.from_env())
