"""The test suite. Importing it is an entry point (pytest's process and every worker a test
spawns import it first): the ``RELAYMOE_*`` environment is checked here, once (a bad value
refused at once). Nothing is installed: a test that wants the environment's options passes
``tests.fixtures.env_config()`` (a ``RingConfig``) to what it calls."""

from relaymoe import options

options.from_env()
