"""What the survivors of a failed collective find out, through the rendezvous store.

The process group is broken after a failure, but the rendezvous store (a TCP key-value store
every rank joined at start) still answers as long as its host lives. Every rank that can still
speak runs :func:`inquire`:

1. it writes its collective trail (:mod:`._trail`), and the trail of every rank of its machine
   whose process is gone (read from the file that process left), then a "here" key;
2. it waits up to ``roll_call_s`` for the "here" keys of the other ranks of the failed group;
3. it reads every trail it can, and the ranks compare them: the first differing collective
   names the ranks on each side, the step, micro-step and module;
4. it waits briefly until the others have read too, so that the store's host does not leave
   while a peer still reads.

No ``torch.distributed`` here: :mod:`._report` passes the store in.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

from . import _trail
from ._trail import Entry

__all__ = ["Findings", "inquire", "announce_trail", "process_gone"]

_PATHS = "shardtrain/trail-file/"  # rank -> "host<TAB>pid<TAB>path" of its trail file
_READ_WAIT_S = 2.0


@dataclass
class Findings:
    """What a rank learned after a failure: ``missing`` ranks did not answer (None: the store
    itself is gone), ``ended`` ranks are known to have no process any more, ``trails`` holds
    every trail read (rank -> entries)."""

    missing: Optional[List[int]]
    ended: Set[int] = field(default_factory=set)
    trails: Dict[int, List[Entry]] = field(default_factory=dict)


def announce_trail(store, rank: int, path: str) -> None:
    """Tells the other ranks where this rank's trail file lives (once, when it is made)."""
    store.set(f"{_PATHS}{rank}", f"{socket.gethostname()}\t{os.getpid()}\t{path}")


def inquire(store, attempt: int, ranks: List[int], me: int, mine: List[Entry],
            roll_call_s: float) -> Findings:
    """Roll call and trail exchange over ``ranks`` (this rank ``me`` among them) for failure
    number ``attempt`` of this process. ``store`` is the rendezvous store with its timeout
    already short; any error of the store means its host is gone: ``missing`` is None."""
    prefix = f"shardtrain/failure/{attempt}/"
    try:
        store.set(f"{prefix}trail/{me}", _trail.encode(mine))
        store.set(f"{prefix}here/{me}", "1")
        missing, ended = _roll_call(store, prefix, [r for r in ranks if r != me], roll_call_s)
        found = Findings(missing, ended)
        for r in ranks:
            if store.check([f"{prefix}trail/{r}"]):
                found.trails[r] = _trail.decode(store.get(f"{prefix}trail/{r}").decode())
        store.set(f"{prefix}read/{me}", "1")
        answered = [r for r in ranks if r not in missing]
        _wait_for(store, [f"{prefix}read/{r}" for r in answered], answered, _READ_WAIT_S)
        return found
    except Exception:  # noqa: BLE001 - any store error means its host (rank 0) is gone
        return Findings(None, trails={me: mine})


def _roll_call(store, prefix: str, others: List[int], seconds: float):
    """Waits up to ``seconds`` for the others' "here" keys; a rank of this machine whose
    process has gone is not waited for: its trail file is published for it. Returns the
    ranks that did not answer and those known to have ended."""
    deadline = time.monotonic() + seconds
    waiting, ended = list(others), set()
    while waiting:
        for r in list(waiting):
            if store.check([f"{prefix}here/{r}"]):
                waiting.remove(r)
            elif store.check([f"{prefix}ended/{r}"]) or _publish_if_ended(store, prefix, r):
                ended.add(r)
                waiting.remove(r)
        if not waiting or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return sorted(waiting) + sorted(ended), ended


def _wait_for(store, keys: List[str], ranks: List[int], seconds: float) -> List[int]:
    """The ranks whose key is still absent after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.1)


def _publish_if_ended(store, prefix: str, rank: int) -> bool:
    """When ``rank`` ran on this machine and its process is gone, writes the trail its file
    holds for the others (and an "ended" key) and returns True."""
    if not store.check([f"{_PATHS}{rank}"]):
        return False
    host, pid, path = store.get(f"{_PATHS}{rank}").decode().split("\t", 2)
    if host != socket.gethostname() or not process_gone(int(pid)):
        return False
    try:
        store.set(f"{prefix}trail/{rank}", _trail.encode(_trail.read(path)))
    except OSError:  # removed already: nothing to add
        pass
    store.set(f"{prefix}ended/{rank}", "1")
    return True


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this machine has ended (a zombie, ended but not yet
    collected by its parent, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
        return state in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
