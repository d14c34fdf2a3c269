"""Runs a function on N real processes (gloo on CPU) and brings back their results.

One call starts one process group; the function it runs usually checks many cases, so a
test module pays for process start-up once, and the ranks are forked from a server that has
imported torch and shardtrain already (a launch takes a fraction of a second, not ten).
Every run has a deadline: a hang fails in seconds with each rank's output instead of
blocking the suite.
"""
from __future__ import annotations

import importlib
import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch


class RanksFailed(AssertionError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What a worker prints when it aborts in C++ teardown after its Python code has finished
#: (with PYTHONFAULTHANDLER=1 the main thread shows no Python frame): a gloo worker thread
#: freeing its last collective's tensors while the interpreter exits. comm.init_distributed
#: removes the known cause (see comm._process._import_dynamo_first); the jobs run again once if it
#: shows up anyway, with a warning, so that a teardown race below shardtrain does not fail a
#: test about training.
EXIT_ABORT = ("terminate called without an active exception", "<no Python frame>")


def aborted_at_exit(output: str) -> bool:
    """Whether a job's output shows a worker aborting after its Python code had finished."""
    return all(marker in output for marker in EXIT_ABORT)


def run_job(cmd: List[str], env: Dict[str, str], cwd, timeout: float = 150,
            reset: Callable[[], None] = lambda: None) -> Tuple[int, str]:
    """Runs a one-node ``shardtrain run`` job; returns (exit status, output). A job whose
    worker aborted at exit (``aborted_at_exit``) runs once more, after ``reset``; a job past
    ``timeout`` seconds is killed (with its workers) and fails the test."""
    env = dict(env, PYTHONFAULTHANDLER="1")
    for attempt in (1, 2):
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: one process group
            out, _ = proc.communicate()
            pytest.fail(f"{' '.join(map(str, cmd[:4]))} ... passed its {timeout:.0f} s deadline:\n"
                        f"{out[-6000:]}")
        if not aborted_at_exit(out) or attempt == 2:
            return proc.returncode, out
        warnings.warn(f"a worker aborted at exit; running the job again:\n{out[-2000:]}",
                      stacklevel=2)
        reset()
    raise AssertionError("unreachable")


def _entry(rank: int, world_size: int, port: int, target: str, kwargs: Dict[str, Any],
           results, log_path: str, extra_env: Dict[str, str]) -> None:
    log = open(log_path, "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1"})
    os.environ.setdefault("SHARDTRAIN_ACCELERATOR", "cpu")
    os.environ.update(extra_env)
    torch.set_num_threads(1)
    try:
        import shardtrain
        shardtrain.init_distributed()
        module_name, fn_name = target.split(":")
        fn = getattr(importlib.import_module(module_name), fn_name)
        value = fn(rank=rank, world_size=world_size, **kwargs)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
        shardtrain.destroy()
    except BaseException:  # report every failure, then exit non-zero
        traceback.print_exc()
        results.put((rank, "error", traceback.format_exc()))
        sys.exit(1)


_CONTEXT = None


def _context():
    """Rank processes forked from a server that has imported torch and shardtrain once (a
    fresh interpreter per rank would import them again: most of a launch's seconds). The
    server holds no process group and no threads of training; each rank starts its own."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "shardtrain", "_dist"])
    return _CONTEXT


def run_ranks(target: str, world_size: int, timeout: float = 180.0,
              env: Optional[Dict[str, str]] = None, need: Optional[List[int]] = None,
              **kwargs: Any) -> List[Any]:
    """Runs ``module:function(rank=, world_size=, **kwargs)`` on ``world_size`` processes.

    Returns the per-rank return values (loaded with ``torch.load``), in rank order.
    Raises RanksFailed with every rank's output on an error, a crash or the deadline. With
    ``need``, only those ranks must report (the others may die: their value is None).
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    logdir = tempfile.mkdtemp(prefix="shardtrain-ranks-")
    logs = [os.path.join(logdir, f"rank{r}.log") for r in range(world_size)]
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, target, kwargs, results,
                                              logs[r], env or {}), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    needed = set(range(world_size) if need is None else need)
    try:
        while not needed <= set(got):
            try:
                rank, status, payload = results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RanksFailed(f"{target} on {world_size} ranks timed out after "
                                      f"{timeout:.0f}s\n" + _read_logs(logs)) from None
                dead = [p for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r in needed and r not in got]
                if dead and results.empty():
                    time.sleep(0.5)  # let a failing rank's report arrive first
                    if results.empty():
                        raise RanksFailed(f"{target}: a rank exited with code "
                                          f"{dead[0].exitcode}\n" + _read_logs(logs)) from None
                continue
            if status == "error":
                raise RanksFailed(f"{target} failed on rank {rank}:\n{payload}\n"
                                  + _read_logs(logs))
            got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [got.get(r) for r in range(world_size)]


def result(run: Tuple, name: str, rank: int = 0) -> Any:
    """What case ``name`` returned on ``rank``, from a module fixture whose second item is
    ``run_ranks``'s per-rank results; a case that raised fails the test with its traceback."""
    value = run[1][rank][name]
    if isinstance(value, dict) and "error" in value:
        pytest.fail(f"case {name} failed on rank {rank}:\n{value['error']}")
    return value


def _read_logs(logs: List[str]) -> str:
    parts = []
    for rank, path in enumerate(logs):
        try:
            with open(path) as f:
                text = f.read()[-6000:]
        except OSError:
            text = "(no output)"
        parts.append(f"----- rank {rank} -----\n{text}")
    return "\n".join(parts)


def run_cases(cases, rank: int, world_size: int, only=None) -> Dict[str, Any]:
    """Runs each case ``fn(rank, world_size)`` of ``cases`` (name -> fn) on this rank; a case
    that raises is reported as ``{"error": traceback}`` so it does not hide the others. The
    ranks meet at a barrier after each case."""
    from shardtrain import comm
    results: Dict[str, Any] = {}
    for name, fn in cases.items():
        if only and name not in only:
            continue
        try:
            results[name] = fn(rank, world_size)
        except Exception:  # reported per case
            results[name] = {"error": traceback.format_exc()}
        comm.barrier()
    return results
