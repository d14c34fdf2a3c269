"""Activations and their gradients between neighbouring stages: a header saying how many
tensors follow and each one's dtype and shape, then the tensors, in one message, so any shape
and dtype can travel (a shape that changes from one micro-batch to the next included, at the
cost of one more message when the size changes)."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import comm

__all__ = ["send_tensors", "recv_tensors", "Posted", "encode", "decode"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)
HEADER = 64  # int64 words: the count, then (dtype, ndim, *shape) per tensor


def encode(tensors: Sequence[torch.Tensor]) -> List[int]:
    words = [len(tensors)]
    for t in tensors:
        if t.dtype not in DTYPES:
            raise TypeError(f"a pipeline stage cannot send a {t.dtype} tensor; it sends "
                            f"{', '.join(str(d) for d in DTYPES)}.")
        words += [DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(words) > HEADER:
        raise ValueError(f"a stage's output of {len(tensors)} tensors with shapes "
                         f"{[tuple(t.shape) for t in tensors]} needs more than {HEADER} header "
                         "words: pass fewer tensors between stages (pack them into one).")
    return words + [0] * (HEADER - len(words))


def decode(words: List[int]) -> List[tuple]:
    count, at, out = words[0], 1, []
    for _ in range(count):
        dtype, ndim = DTYPES[words[at]], words[at + 1]
        out.append((dtype, tuple(words[at + 2: at + 2 + ndim])))
        at += 2 + ndim
    return out


# One message per transfer: the header and the tensors' bytes in one buffer. A receive needs
# the size of what comes, so each side remembers the size of the last message on a channel
# (a peer and a tag; messages on it arrive in order): while the size holds, one message; when
# it changes, the sender first sends a notice of the old size carrying the new one.
_NOTICE = -1  # first header word of a notice (a header's is a tensor count, >= 0)
_ALIGN = 8    # each tensor's bytes start at a multiple of this (any dtype views them)
_sent: Dict[Tuple[int, int], int] = {}      # (destination, tag) -> bytes of the last message
_expected: Dict[Tuple[int, int], int] = {}  # (source, tag) -> bytes the next message has


def send_tensors(tensors: Sequence[torch.Tensor], dst: int, device: torch.device,
                 tag: int = 0) -> List[comm.Work]:
    """Sends the tensors to global rank ``dst`` (not waiting): one message, after a notice
    when its size differs from the last one sent to ``dst`` with ``tag``."""
    parts = [t.detach().contiguous() for t in tensors]
    message = _pack(encode(parts), parts, device)
    size, last = message.numel(), _sent.get((dst, tag), HEADER * 8)
    works = []
    if size != last:
        notice = torch.zeros(last, dtype=torch.uint8, device=device)
        notice[:16].view(torch.int64).copy_(torch.tensor([_NOTICE, size]))
        works.append(comm.send(notice, dst, tag))
    works.append(comm.send(message, dst, tag))
    _sent[dst, tag] = size
    return works


class Posted:
    """A receive posted ahead of need: the next message from ``src`` with ``tag``, of the
    size that channel's last message had (a notice of a new size has that size too)."""

    def __init__(self, src: int, device: torch.device, tag: int):
        self.src, self.device, self.tag = src, device, tag
        self.message = torch.empty(_expected.get((src, tag), HEADER * 8), dtype=torch.uint8,
                                   device=device)
        self.work = comm.irecv(self.message, src, tag)


def recv_tensors(src: int, device: torch.device, tag: int = 0,
                 posted: Optional[Posted] = None) -> List[torch.Tensor]:
    """What global rank ``src`` sent with :func:`send_tensors` (views into one buffer);
    ``posted``: its receive, posted ahead."""
    if posted is None:
        message = torch.empty(_expected.get((src, tag), HEADER * 8), dtype=torch.uint8,
                              device=device)
        comm.recv(message, src, tag)
    else:
        posted.work.wait()
        message = posted.message
    words = message[:HEADER * 8].view(torch.int64).tolist()
    if words[0] == _NOTICE:
        size = _expected[src, tag] = words[1]
        message = torch.empty(size, dtype=torch.uint8, device=device)
        comm.recv(message, src, tag)
    return _unpack(message)


def _unpack(message: torch.Tensor) -> List[torch.Tensor]:
    out, at = [], HEADER * 8
    for dtype, shape in decode(message[:HEADER * 8].view(torch.int64).tolist()):
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(message[at: at + nbytes].view(dtype).view(shape))
        at += _padded(nbytes)
    return out


def _pack(words: List[int], parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    sizes = [t.numel() * t.element_size() for t in parts]
    message = torch.empty(HEADER * 8 + sum(_padded(n) for n in sizes), dtype=torch.uint8,
                          device=device)
    message[:HEADER * 8].view(torch.int64).copy_(torch.tensor(words))
    at = HEADER * 8
    for t, nbytes in zip(parts, sizes):
        if nbytes:
            message[at: at + nbytes].view(t.dtype).copy_(t.reshape(-1))
        at += _padded(nbytes)
    return message


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN

