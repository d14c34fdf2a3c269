"""The collective trail: the last collectives a rank issued, to name where ranks diverged.

Collectives are matched by order: the n-th collective a rank issues over a group meets the
n-th of every other rank of that group. When one rank takes another branch (skips a module's
forward, issues one more all-reduce, cuts its buckets differently), the ranks pair calls that
do not belong together, and the job hangs or fails somewhere after the real cause. Each rank
therefore writes a record of every collective it issues (its group, its position ``seq`` over
that group, kind, element count, dtype, the module a ZeRO-3 gather fetches, and where training
was) into a ring of fixed-size slots. After a failure the ranks compare their trails and
:func:`first_difference` finds the first position at which they disagree.

The ring lives in a memory-mapped file (about 200 KB per rank): writing a record is a copy into
memory, and the file outlives its process, so a rank that the backend aborted (gloo ends a
process whose peer sent a collective of another size) leaves its trail to the survivors on its
machine. Each group also keeps a running checksum of its calls (:meth:`Trail.fingerprints`),
which ranks compare while the group still works, to catch divergence that does not hang.

No ``torch.distributed`` here: :mod:`._tracing` records this rank's trail, :mod:`._report`
and :mod:`._divergence` exchange and compare them.
"""
from __future__ import annotations

import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

__all__ = ["ORDER", "Entry", "Trail", "Difference", "first_difference", "read", "encode", "decode",
           "spans", "parse_spans"]

#: Suffix of the name under which marks (:func:`shardtrain.comm.mark`) are kept apart from
#: the group's collectives: points every rank passes in the same order, no collectives.
ORDER = " order"
_SLOT = 256                 # bytes per record; longer fields are cut
_HEADER = struct.Struct("<qq")  # records written so far, slots in the ring
_FIELDS = 9


@dataclass(frozen=True)
class Entry:
    """One collective as a rank issued it."""

    group: str   # the group's name ("world", "zero", "tp", ...)
    pg: str      # torch's name for its process group ("0": the default one): calls over
                 # groups of different names but one process group meet each other
    ranks: str   # its global ranks, as spans ("0-3, 6")
    seq: int     # 1 for the first collective over this process group, 2 for the next, ...
    op: str
    numel: int
    dtype: str
    label: str   # the module whose parameters a ZeRO-3 gather fetches ("" otherwise)
    where: str   # step, micro-step and phase when it was issued

    @property
    def key(self) -> Tuple[str, int, str, str]:
        """What must be equal on every rank of the group for the call to match."""
        return (self.op, self.numel, self.dtype, self.label)

    def describe(self) -> str:
        if not self.dtype:  # a collective without a tensor, or a mark: "forward of blocks.1"
            what, module = self.op, f" of {self.label}" if self.label else ""
        else:
            what = f"{self.op} of {self.numel:,} {self.dtype} elements"
            module = f" for {self.label}" if self.label else ""
        where = f" ({self.where})" if self.where else ""
        return f"{what}{module}{where}"


def _fingerprint(op: str, numel: int, dtype: str, label: str, previous: int) -> int:
    return zlib.crc32(f"{op}|{numel}|{dtype}|{label}".encode(), previous)


class Trail:
    """A ring of the last ``slots`` collectives, in ``path`` (a file this process creates and
    later removes) or in memory when ``path`` is None.

    Example:
        >>> trail = Trail(slots=4)
        >>> trail.record("world", "0", "0-1", "all_reduce", 10, "float32", "", "step 1")
        >>> trail.entries()[0].seq
        1
    """

    def __init__(self, slots: int = 1024, path: Optional[str] = None):
        if slots < 1:
            raise ValueError(f"a trail needs at least one slot, got {slots}.")
        self.slots, self.path = slots, path
        size = _HEADER.size + slots * _SLOT
        if path is None:
            self._buf = bytearray(size)
        else:
            with open(path, "wb+") as f:
                f.truncate(size)
                self._buf = mmap.mmap(f.fileno(), size)
        self._written = 0
        _HEADER.pack_into(self._buf, 0, 0, slots)
        self._seq: Dict[Tuple[str, str], int] = {}
        self._crc: Dict[Tuple[str, str], int] = {}

    def record(self, group: str, pg: str, ranks: str, op: str, numel: int, dtype: str,
               label: str, where: str) -> None:
        """Writes the next collective over process group ``pg`` (over global ``ranks``),
        called through the group named ``group``."""
        gkey = (pg, ranks)
        seq = self._seq.get(gkey, 0) + 1
        self._seq[gkey] = seq
        self._crc[gkey] = _fingerprint(op, numel, dtype, label, self._crc.get(gkey, 0))
        line = f"{seq}\t{group}\t{pg}\t{ranks}\t{op}\t{numel}\t{dtype}\t{label}\t{where}".encode()
        start = _HEADER.size + (self._written % self.slots) * _SLOT
        self._buf[start: start + _SLOT] = line[:_SLOT].ljust(_SLOT, b"\0")
        self._written += 1
        _HEADER.pack_into(self._buf, 0, self._written, self.slots)

    def entries(self) -> List[Entry]:
        """The records still in the ring, oldest first."""
        return _entries(bytes(self._buf))

    def fingerprints(self) -> Dict[Tuple[str, str], Tuple[int, int]]:
        """Per process group (``pg``, ranks): how many collectives were issued over it and a checksum
        of their kinds, sizes, dtypes and modules; equal on every rank of the group as long
        as the ranks issued the same calls."""
        return {g: (n, self._crc[g]) for g, n in self._seq.items()}

    def close(self, remove: bool = True) -> None:
        if isinstance(self._buf, mmap.mmap):
            self._buf.close()
            self._buf = bytearray(_HEADER.size)
            if remove and self.path is not None:
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass


def read(path: str) -> List[Entry]:
    """The records of the trail file ``path`` (written by another process, maybe ended)."""
    with open(path, "rb") as f:
        return _entries(f.read())


def _entries(raw: bytes) -> List[Entry]:
    if len(raw) < _HEADER.size:
        return []
    written, slots = _HEADER.unpack_from(raw, 0)
    first = max(0, written - slots)
    out = []
    for i in range(first, written):
        start = _HEADER.size + (i % slots) * _SLOT
        entry = _parse(raw[start: start + _SLOT].rstrip(b"\0").decode(errors="replace"))
        if entry is not None:
            out.append(entry)
    return out


def _parse(line: str) -> Optional[Entry]:
    fields = line.split("\t")
    if len(fields) != _FIELDS:
        return None  # a record cut short, or half-written when its process died
    seq, group, pg, ranks, op, numel, dtype, label, where = fields
    try:
        return Entry(group, pg, ranks, int(seq), op, int(numel), dtype, label, where)
    except ValueError:
        return None


def encode(entries: Iterable[Entry]) -> str:
    """The entries as text, to pass through the rendezvous store."""
    return "\n".join(f"{e.seq}\t{e.group}\t{e.pg}\t{e.ranks}\t{e.op}\t{e.numel}\t{e.dtype}"
                     f"\t{e.label}\t{e.where}" for e in entries)


def decode(text: str) -> List[Entry]:
    return [e for e in (_parse(line) for line in text.split("\n") if line) if e is not None]


def spans(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 6]`` as ``"0-3, 6"``."""
    out: List[str] = []
    run: List[int] = []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(_span(run))
        run = [r]
    if run:
        out.append(_span(run))
    return ", ".join(out)


def _span(run: List[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def parse_spans(text: str) -> List[int]:
    out: List[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


@dataclass
class Difference:
    """The first position over process group ``pg`` (of global ``ranks``) at which the
    ranks' calls differ: ``calls`` holds each rank's call there (None: the rank had not
    issued it), ``last`` the last call over the group of each rank that had not."""

    pg: str
    ranks: str
    seq: int
    calls: Dict[int, Optional[Entry]]
    last: Dict[int, Optional[Entry]]

    def explain(self, ended: Iterable[int] = ()) -> str:
        """Lines naming the differing calls, ranks with the same call together; ``ended``:
        ranks whose process is gone (their trail was read from the file they left)."""
        ended = set(ended)
        known = [e for e in list(self.calls.values()) + list(self.last.values()) if e]
        names = " / ".join(sorted({e.group for e in known}))
        if self.pg.endswith(ORDER):
            head = (f"The ranks first differ at module #{self.seq} of the forward order over "
                    f"the {names} group (ranks {self.ranks}):")
        else:
            head = (f"The ranks' collectives first differ at collective #{self.seq} over the "
                    f"{names} group (ranks {self.ranks}):")
        lines = [head]
        same: Dict[str, List[int]] = {}
        for rank, call in sorted(self.calls.items()):
            same.setdefault(self._say(rank, call, ended), []).append(rank)
        for text, ranks in same.items():
            who = "rank" if len(ranks) == 1 else "ranks"
            lines.append(f"  {who} {spans(ranks)}: {text}")
        return "\n".join(lines)

    def _say(self, rank: int, call: Optional[Entry], ended: set) -> str:
        if call is not None:
            return call.describe()
        last = self.last.get(rank)
        before = f"its last was #{last.seq}, {last.describe()}" if last is not None \
            else "none over this group is in its trail"
        state = "ended without issuing it" if rank in ended else "had not issued it"
        return f"{state} ({before})"


def first_difference(trails: Dict[int, List[Entry]],
                     order: Optional[List[Entry]] = None) -> Optional[Difference]:
    """The first position at which the ranks' trails disagree (a call with another kind,
    size, dtype or module, or a call some rank of the group had not issued), or None.
    Positions are compared where every compared trail still holds them. With several groups,
    the difference that comes first in ``order`` (the reporting rank's trail) wins."""
    found: List[Difference] = []
    for (pg, ranks), per_rank in _by_group(trails).items():
        members = [r for r in parse_spans(ranks) if r in per_rank]
        if len(members) < 2:
            continue
        diff = _first_in_group(pg, ranks, {r: per_rank[r] for r in members})
        if diff is not None:
            found.append(diff)
    if not found:
        return None
    position = {(e.pg, e.ranks, e.seq): i for i, e in enumerate(order or [])}
    return min(found, key=lambda d: (position.get((d.pg, d.ranks, d.seq), len(position)),
                                     d.seq))


def _by_group(trails: Dict[int, List[Entry]]) -> Dict[Tuple[str, str], Dict[int, Dict[int, Entry]]]:
    out: Dict[Tuple[str, str], Dict[int, Dict[int, Entry]]] = {}
    for rank, entries in trails.items():
        for e in entries:
            out.setdefault((e.pg, e.ranks), {}).setdefault(rank, {})[e.seq] = e
    return out


def _first_in_group(pg: str, ranks: str, calls: Dict[int, Dict[int, Entry]]
                    ) -> Optional[Difference]:
    start = max(min(seqs) for seqs in calls.values())  # held by every trail from here on
    end = max(max(seqs) for seqs in calls.values())
    for seq in range(start, end + 1):
        here = {r: seqs.get(seq) for r, seqs in calls.items()}
        keys = {e.key for e in here.values() if e is not None}
        if len(keys) > 1 or None in here.values():
            last = {r: seqs[max(seqs)] for r, seqs in calls.items() if here[r] is None}
            return Difference(pg, ranks, seq, here, last)
    return None
