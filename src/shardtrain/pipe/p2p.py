"""Activations and their gradients between neighbouring stages: a header saying how many
tensors follow and each one's dtype and shape, then the tensors, so any shape and dtype can
travel (a shape that changes from one micro-batch to the next included)."""
from __future__ import annotations

from typing import List, Sequence

import torch

from .. import comm

__all__ = ["send_tensors", "recv_tensors", "encode", "decode"]

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


def send_tensors(tensors: Sequence[torch.Tensor], dst: int, device: torch.device,
                 tag: int = 0) -> List[comm.Work]:
    """Sends the header and every non-empty tensor to global rank ``dst`` (not waiting)."""
    parts = [t.detach().contiguous() for t in tensors]
    works = [comm.send(torch.tensor(encode(parts), dtype=torch.int64, device=device), dst, tag)]
    works += [comm.send(t, dst, tag) for t in parts if t.numel()]
    return works


def recv_tensors(src: int, device: torch.device, tag: int = 0) -> List[torch.Tensor]:
    """What global rank ``src`` sent with :func:`send_tensors`."""
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    comm.recv(header, src, tag)
    out = []
    for dtype, shape in decode(header.tolist()):
        t = torch.empty(shape, dtype=dtype, device=device)
        if t.numel():
            comm.recv(t, src, tag)
        out.append(t)
    return out
