"""Model states moved off the device and back on demand, in place.

Between training phases (generation in reinforcement learning, evaluation of another model),
the states a step needs but a forward does not can leave the device. Every tensor keeps its
identity: the optimizer's state dict, its param groups, a parameter's views and the gradient
views into a flat bucket all keep pointing at the same storage. Moving a storage out copies its
bytes into a host buffer and resizes the storage to zero bytes (the device memory is freed,
and every view of it stays what it is); moving it back resizes it and copies the bytes in.
Bytes, not values: no dtype conversion, so a reload gives the states bit for bit.

Storages are moved once however many kinds name them (in fp32 training the optimizer updates
the parameters themselves, so the master weights and the 16-bit parameters are one memory):
:attr:`StateOffload.kinds` says which kinds have any storage off the device.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Set, Tuple

import torch

__all__ = ["StateOffload", "STATE_KINDS"]

#: The kinds of model state, by the names of DeepSpeed's ``OffloadStateTypeEnum``.
STATE_KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")

_Key = int  # a storage's identity (its implementation's address), which a resize keeps


class StateOffload:
    """The host copies of the storages moved off the device, and which kinds they belong to.

    Example:
        >>> moved = StateOffload()
        >>> moved.offload({"optim_states": states}, ["optim_states"], pin_memory=False)
        >>> moved.kinds
        {'optim_states'}
        >>> moved.reload()
    """

    def __init__(self) -> None:
        self._moved: Dict[_Key, Tuple[torch.UntypedStorage, torch.Tensor]] = {}
        self.kinds: Set[str] = set()

    def offload(self, states: Dict[str, List[torch.Tensor]], include: Iterable[str],
                pin_memory: bool = False, non_blocking: bool = False) -> int:
        """Moves the storages of the ``include`` kinds of ``states`` (kind -> tensors) to host
        memory; returns the bytes freed. All storages are checked before any moves, so a
        refusal leaves everything where it was."""
        wanted = [t for kind in include for t in states.get(kind, ())]
        storages = [(key, s) for key, s in _distinct(wanted)
                    if key not in self._moved and s.nbytes() > 0]
        fixed = [s for _, s in storages if not s.resizable()]
        if fixed:
            raise ValueError(
                f"offload_states: {len(fixed)} storage(s) ({fixed[0].nbytes():,} bytes, on "
                f"{fixed[0].device}) cannot be freed in place (memory-mapped or borrowed from "
                "another library); copy the model's weights into memory of their own (e.g. "
                "model.to(device) from a copy) before initialize(), or leave those states out.")
        freed = 0
        for key, storage in storages:
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu",
                               pin_memory=pin_memory)
            host.copy_(_bytes_of(storage), non_blocking=non_blocking)
            freed += storage.nbytes()
            storage.resize_(0)  # the device memory goes; every view keeps its place
            self._moved[key] = (storage, host)
        self.kinds = {kind for kind, tensors in states.items()
                      if any(key in self._moved for key, _ in _distinct(tensors))}
        return freed

    def reload(self, non_blocking: bool = False) -> int:
        """Puts every moved storage back where it was, with its bytes; returns them."""
        restored = 0
        for storage, host in self._moved.values():
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=non_blocking)
            restored += host.numel()
        self._moved.clear()
        self.kinds = set()
        return restored

    @property
    def host_bytes(self) -> int:
        """Bytes held in host memory for the storages off the device."""
        return sum(host.numel() for _, host in self._moved.values())


def _distinct(tensors: Iterable[torch.Tensor]) -> List[Tuple[_Key, torch.UntypedStorage]]:
    """Each storage of ``tensors`` once."""
    seen: Dict[_Key, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen.setdefault(storage._cdata, storage)
    return list(seen.items())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,))
