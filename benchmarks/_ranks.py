"""Starting a benchmark's ranks: one spawned process per rank, rank 0's result back."""
from __future__ import annotations

import os
import queue as queues
import signal
import socket
import sys
import time
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(worker: Callable, device: str, rank: int, world: int, port: int, *rest: Any) -> None:
    """A rank's process: the variables shardtrain.init_distributed reads, then the worker."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      SHARDTRAIN_ACCELERATOR=device)
    worker(rank, world, port, *rest)


def run_ranks(worker: Callable, world: int, *args: Any, device: str = "cpu",
              timeout: float = 1800) -> Any:
    """Runs ``worker(rank, world, port, *args, queue)`` on ``world`` processes (each with the
    launcher variables of its rank set, on ``device``) and returns what rank 0 puts on the
    queue. Raises SystemExit as soon as a rank fails (the others are stopped) or after
    ``timeout`` seconds."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(worker, device, r, world, port, *args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    result, failure = None, None
    try:
        while result is None and failure is None:
            try:
                result = queue.get(timeout=1.0)
            except queues.Empty:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    failure = f"rank {failed[0]} exited with code {procs[failed[0]].exitcode}"
                elif all(p.exitcode == 0 for p in procs):
                    try:  # the result may have landed just after the wait above
                        result = queue.get(timeout=1.0)
                    except queues.Empty:
                        failure = "the ranks exited without a result"
                elif time.monotonic() > deadline:
                    failure = f"no result after {timeout:.0f} s"
        if failure is None:
            for p in procs:
                p.join(timeout=max(deadline - time.monotonic(), 30))
            aborted = [r for r, p in enumerate(procs) if p.exitcode == -signal.SIGABRT]
            if aborted:  # torch's C++ teardown, after the result was complete: not the figures
                print(f"warning: rank {aborted[0]} aborted while exiting, after its result "
                      f"(a teardown race in torch's process group threads)", file=sys.stderr)
            if any(p.exitcode and p.exitcode != -signal.SIGABRT for p in procs):
                failure = "a rank failed after its result"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if failure is not None:
        raise SystemExit(f"benchmark ranks failed: {failure}; see their output above")
    return result
