"""The one checkpoint save that may run in the background (``checkpoint.async_save``).

Everything that can refuse a save, and every copy of the training state, happens on the
training thread: when :func:`start` returns, training may change the model freely. The
writing, the agreement of the ranks on what was written and the publication run in a thread
of their own, over a side process group (:func:`shardtrain.comm.side_group`), because the
training thread's collectives on the default group are matched by order and must not
interleave with the writer's.

At most one save is in flight: the next save, a load, ``shardtrain.destroy()`` and the end of
the process (the thread is not a daemon) wait for it, and an error it met is raised there.
The atomicity of a save is the same as in the foreground: a process killed while the thread
writes leaves the previous checkpoint and ``latest`` as they were.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from .. import comm
from ..log import logger

__all__ = ["start", "wait_for_checkpoint"]

_thread: Optional[threading.Thread] = None
_error: Optional[BaseException] = None


def start(fn: Callable[..., Any], *args: Any) -> None:
    """Runs ``fn(*args)`` in the background, after any save still in flight."""
    global _thread
    wait_for_checkpoint()
    comm.before_destroy(wait_for_checkpoint)
    _thread = threading.Thread(target=_run, args=(fn, args), name="shardtrain-checkpoint")
    _thread.start()


def _run(fn: Callable[..., Any], args: tuple) -> None:
    global _error
    try:
        fn(*args)
    except BaseException as error:  # kept, and raised on the training thread at the next wait
        logger.error("checkpoint: the background save failed: %s", error)
        _error = error


def wait_for_checkpoint() -> None:
    """Waits for the asynchronous save in flight, if any, and raises the error it met.
    ``save_checkpoint`` and ``load_checkpoint`` call it first; call it yourself before
    reading the files of a save you started asynchronously.

    Example:
        >>> engine.save_checkpoint("checkpoints")   # with checkpoint.async_save: true
        >>> shardtrain.checkpoint.wait_for_checkpoint()
    """
    global _thread, _error
    if _thread is not None:
        _thread.join()
        _thread = None
    if _error is not None:
        error, _error = _error, None
        raise error
