"""The helper process of megatron-core's ``torch_dist`` checkpoint writer, stopped once a process
is done saving: ``stop_checkpoint_writer``.

Every ``torch_dist`` save in megatron-core 0.19, synchronous ones included
(``TorchDistSaveShardedStrategy.save``), writes through ``FileSystemWriterAsync``, which collects
its write results through a queue of a spawned ``multiprocessing`` Manager: a server process,
started by the first save of a process that has tensors to write, and kept in a module global
(``filesystem_async._results_queue``) for every later save. The results it holds are torch
objects, so the server imports torch on the first one (about 0.5 GB resident). megatron-core
never shuts it down: only multiprocessing's exit handler does, when the interpreter exits
normally. A process that leaves any other way (``os._exit``, a signal, a launcher's kill) leaves
it running, orphaned, with the stdout and stderr it inherited still open (a pipe reading them
never ends). megatron-core's own reset (``megatron.training.async_utils.
reset_persistent_async_worker``) reads its import-time copy of that global, None, and stops
nothing; no public call reaches the manager. So a process that saves once (``relaymoe
convert-hf``, a test's training script) stops it here, right after its save; a later save starts
a fresh one.

The one private name is read in this one function; ``tests/lib/test_checkpoint_writer.py``
fails when megatron-core renames or reshapes it.
"""

from __future__ import annotations

__all__ = ["stop_checkpoint_writer"]


def stop_checkpoint_writer() -> bool:
    """Shut down the write-results Manager of megatron-core's ``torch_dist`` writer in this
    process, if one runs (waiting for its process to end); whether one ran. Call it only between
    saves: a save in flight on another thread would lose its results queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = getattr(filesystem_async, "_results_queue", None)
    if queue is None:
        return False
    filesystem_async._results_queue = None  # the next save makes a new one
    manager = getattr(queue, "_manager", None)  # the proxy's owner (multiprocessing.managers)
    if manager is None:
        return False
    manager.shutdown()
    return True
