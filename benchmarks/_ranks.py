"""Starting a benchmark's ranks: one spawned process per rank, rank 0's result back."""
from __future__ import annotations

import socket
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: Callable, world: int, *args: Any, timeout: float = 1800) -> Any:
    """Runs ``worker(rank, world, port, *args, queue)`` on ``world`` processes and returns what
    rank 0 puts on the queue; exits with an error if a rank fails."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=timeout)
    finally:
        for p in procs:
            p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit("a benchmark rank failed; see its output above")
    return result
