"""A captured program's starting state, made only where it is taken.

Capture copies nothing: a parameter's starting value is a copy of the model's
tensor made when a process takes it, and its optimizer state (Adam's moments,
Adagrad's sums) is made from the parameter's shape then. So a process makes
only the state it owns (a parameter server its own parameters and their
moments), and a server of its own process can free the model's tensors once
it holds its own (`InitialState.take(..., free_sources=True)`): no process
holds the model, a copy of it and the whole optimizer state at once.

Reading a deferred entry (`state[key]`) makes it afresh each time, from the
model's tensor as it is then: the model must not change between capture and
the start of the job (as a cached table's module must not).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass

import torch

from .errors import SplitrunError

__all__ = ["Deferred", "InitialState", "copy_state", "free_storages"]


@dataclass(frozen=True)
class Deferred:
    """A state entry made when taken: `make(source)`. `reads_values`: whether
    it reads the source's values (a copy) or only its shape, dtype and
    device (an optimizer's starting state), which still works once the
    source's memory is freed."""

    source: torch.Tensor
    make: Callable[[torch.Tensor], torch.Tensor]
    reads_values: bool = True


class InitialState(MutableMapping):
    """State key -> tensor, some entries `Deferred`. A plain dict's behaviour
    for reading and writing; `take` is how a process gets its own entries."""

    def __init__(self, entries: Mapping[str, torch.Tensor | Deferred] | None = None) -> None:
        self._entries: dict[str, torch.Tensor | Deferred] = dict(entries or {})
        # Who freed the model's tensors, shared by every copy and subset (the
        # tensors are gone for all of them).
        self._freed_by: list[str] = []

    def __getitem__(self, key: str) -> torch.Tensor:
        entry = self._entries[key]
        if not isinstance(entry, Deferred):
            return entry
        if entry.reads_values and self._freed_by:
            raise SplitrunError(
                f"initial state {key!r} is gone: {self._freed_by[0]} freed the model's tensors "
                f"once it held its own state; read the trained state from "
                f"`trainer.finish()` on worker 0 instead")
        return entry.make(entry.source)

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self._entries[key] = value

    def __delitem__(self, key: str) -> None:
        del self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        deferred = sum(isinstance(e, Deferred) for e in self._entries.values())
        return f"InitialState({len(self)} entries, {deferred} made when taken)"

    def copy(self) -> InitialState:
        """Another mapping over the same entries (nothing made)."""
        return self.subset(self._entries)

    def subset(self, keys) -> InitialState:
        """The entries of `keys` (nothing made)."""
        other = InitialState({key: self._entries[key] for key in keys})
        other._freed_by = self._freed_by
        return other

    def like(self, key: str) -> torch.Tensor:
        """A tensor with the entry's shape, dtype and device, its values not
        made: the model's tensor for a copy (read only!), else the entry."""
        entry = self._entries[key]
        if not isinstance(entry, Deferred):
            return entry
        return entry.source if entry.reads_values else self[key]

    def nbytes(self, key: str) -> int:
        """The bytes the entry holds once made, found without making it."""
        entry = self._entries[key]
        if not isinstance(entry, Deferred):
            return entry.nbytes if isinstance(entry, torch.Tensor) else 0
        try:
            return entry.make(entry.source.to("meta")).nbytes
        except (RuntimeError, NotImplementedError):  # a make that needs values: the source's
            return entry.source.numel() * entry.source.element_size()

    def take(self, keys, *, free_sources: bool = False, taker: str = "a process"
             ) -> dict[str, torch.Tensor]:
        """The entries of `keys`, made. With `free_sources` (a process of its
        own: threads of one process share the model), the memory of every
        tensor the deferred entries were made from (the model's parameters,
        buffers) is given back once the copies are made and before the
        optimizer state is: the model on this process then holds 0-byte
        tensors, and reading a copy again is refused, naming `taker`."""
        keys = list(keys)
        copies = [k for k in keys if isinstance(self._entries[k], Deferred)
                  and self._entries[k].reads_values]
        taken = {key: self[key] for key in copies}
        if free_sources:
            free_storages(entry.source for entry in self._entries.values()
                          if isinstance(entry, Deferred))
            self._freed_by.append(taker)
        taken.update({key: self[key] for key in keys if key not in taken})
        return {key: taken[key] for key in keys}


def copy_state(state: Mapping[str, torch.Tensor]) -> MutableMapping[str, torch.Tensor]:
    """A mapping to change without changing `state`; nothing made."""
    return state.copy() if isinstance(state, InitialState) else dict(state)


def free_storages(tensors) -> int:
    """Give back the memory of CPU `tensors`: their storage is resized to 0
    bytes, so every tensor sharing it is emptied at once and must not be
    read again. Returns the bytes freed."""
    freed, seen = 0, set()
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        size = storage.nbytes()
        try:
            storage.resize_(0)
        except RuntimeError:  # not resizable (a buffer torch does not own): kept
            continue
        freed += size
    return freed
