"""The harnesses. Importing the package is an entry point (each benchmark's process and the
workers it spawns import it first): the ``RELAYMOE_*`` environment is read once into
``ENV_CONFIG`` (``relaymoe.options.from_env``, a ``RingConfig``), which the harnesses hand to
what they call (``ring_moe(..., config=)``, the kernels' ``kernels=``)."""

from relaymoe import options

ENV_CONFIG = options.from_env()
