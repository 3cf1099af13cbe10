"""Which partitions of a model a rank keeps resident, and the store the others wait in.

Wavelet's round-robin schedule (§3.3) takes every rank through all N partitions of the model;
at any moment a rank needs only the partition it computes and the one it prefetches. A
:class:`PartitionResidency` moves a partition's training state (its trainable parameters,
their ``.grad`` and the optimizer's state tensors for them) out of the rank's memory into a
per-rank store and back:

- **evict**: the bytes of each storage are copied into the store (pinned host memory when the
  storage is on a GPU, a separate CPU buffer otherwise), then the storage is resized to 0 bytes;
- **load**: the storage is resized back and its bytes are copied in, bit for bit.

The tensors themselves stay: the same ``Parameter`` objects with their shapes, the
optimizer's references to them, and every view of them (a captured graph's transposed weight).
A view shares its base's storage, so once the partition is loaded again it reads the loaded
bytes. While a partition is evicted its tensors have no bytes, so nothing may read them until
it is loaded again: :meth:`~PartitionResidency.require` raises for a partition that is not
resident. A tensor that several partitions use (tied weights) stays while any partition using
it is resident. Buffers and frozen parameters are not moved.

:meth:`~PartitionResidency.resident_partitions` and :meth:`~PartitionResidency.resident_bytes`
read the tensors themselves (which storages hold bytes), not the bookkeeping;
:meth:`~PartitionResidency.observe` records their maxima (``peak_partitions``,
``peak_bytes``). It may run on another thread than a switch: a switch evicts before it loads,
so what it sees mid-switch never exceeds what is resident before or after the switch.

Example:
    >>> import torch
    >>> a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1, momentum=0.9)
    >>> res = PartitionResidency([list(a.named_parameters()), list(b.named_parameters())], opt)
    >>> weight, before = b.weight, b.weight.detach().clone()
    >>> res.switch({0}), res.resident_partitions(), b.weight.untyped_storage().nbytes()
    (Moved(evicted=40, loaded=0), [0], 0)
    >>> res.require(1, "F1,0")
    Traceback (most recent call last):
    ...
    tidal.runtime.weights.residency.ResidencyError: rank 0: F1,0 needs partition 1, ...
    >>> res.switch({1}), res.resident_partitions()
    (Moved(evicted=80, loaded=40), [1])
    >>> b.weight is weight and torch.equal(b.weight, before), a.weight.untyped_storage().nbytes()
    (True, 0)
    >>> res.load_all(), res.resident_bytes(), res.peak_partitions
    (80, 120, 0)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Sequence

import torch

from tidal.ir.errors import TidalError


class ResidencyError(TidalError):
    """A partition's tensors were read while it was evicted, or cannot be loaded (its store
    entry is missing); the message names the rank, the partition and the tensor."""


class Moved(NamedTuple):
    """Bytes a switch moved out of the rank (``evicted``) and into it (``loaded``)."""

    evicted: int
    loaded: int

    @property
    def total(self) -> int:
        return self.evicted + self.loaded


@dataclass
class _Block:
    """One evicted storage: every tensor of the evicted partitions sharing it (kept alive, so
    their ids stay theirs while they key the store) and the store's copy of its bytes."""

    tensors: list[torch.Tensor]
    data: torch.Tensor


def _ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (0 when it holds no bytes)."""
    return t.untyped_storage().data_ptr()


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole of ``storage`` as a flat uint8 tensor sharing it."""
    n = storage.nbytes()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))


def _sync(devices: set[torch.device]) -> None:
    """Wait for the copies enqueued on the current stream of each CUDA device in ``devices``."""
    for d in devices:
        if d.type == "cuda":
            torch.cuda.current_stream(d).synchronize()


class PartitionResidency:
    """The residency of ``partitions`` (per partition, its ``(name, parameter)`` pairs) on rank
    ``rank``, all resident at first; ``optimizer``'s state for a parameter moves with it (see
    the module docstring). ``resident`` is the set of partitions loaded (the bookkeeping);
    ``peak_partitions``/``peak_bytes`` what :meth:`observe` saw at most."""

    def __init__(self, partitions: Sequence[Sequence[tuple[str, torch.Tensor]]],
                 optimizer: Optional[torch.optim.Optimizer] = None, rank: int = 0):
        self._parts = [list({id(t): (name, t) for name, t in part}.values())
                       for part in partitions]
        self.optimizer = optimizer
        self.rank = rank
        self.resident: set[int] = set(range(len(self._parts)))
        users: dict[int, int] = {}
        for part in self._parts:
            for _, t in part:
                users[id(t)] = users.get(id(t), 0) + 1
        self._alone = [[t for _, t in part if users[id(t)] == 1] for part in self._parts]
        self._evicted: dict[int, _Block] = {}   # id of a tensor -> its storage's store entry
        self._lock = threading.Lock()
        self.peak_partitions = 0
        self.peak_bytes = 0

    @property
    def partitions(self) -> int:
        return len(self._parts)

    def tensors(self, p: int) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of partition ``p``'s training state: each parameter, its ``.grad``
        and the optimizer's state tensors for it."""
        state = self.optimizer.state if self.optimizer is not None else {}
        out = []
        for name, prm in self._parts[p]:
            out.append((name, prm))
            if prm.grad is not None:
                out.append((f"{name}.grad", prm.grad))
            for k, v in tuple((state.get(prm) or {}).items()):
                if isinstance(v, torch.Tensor):
                    out.append((f"{name} (optimizer state {k!r})", v))
        return out

    # -- what the tensors hold ---------------------------------------------------------------
    def resident_partitions(self) -> list[int]:
        """The partitions whose parameters hold bytes, read from the tensors: a partition
        counts when a parameter that it alone uses holds bytes (when all its parameters are
        shared with other partitions: when they all do)."""
        out = []
        for p, (part, alone) in enumerate(zip(self._parts, self._alone)):
            held = [t for t in (alone or [t for _, t in part]) if t.untyped_storage().nbytes()]
            if held and (alone or len(held) == len(part)):
                out.append(p)
        return out

    def resident_bytes(self) -> int:
        """Bytes of the distinct storages of every partition's training state that hold
        bytes now (parameters, gradients, optimizer state)."""
        seen: dict[int, int] = {}
        for p in range(self.partitions):
            for _, t in self.tensors(p):
                s = t.untyped_storage()
                if s.data_ptr():
                    seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    def observe(self) -> None:
        """Record the resident partitions and bytes, read from the tensors, in
        ``peak_partitions`` and ``peak_bytes`` (their maxima)."""
        count, size = len(self.resident_partitions()), self.resident_bytes()
        with self._lock:
            self.peak_partitions = max(self.peak_partitions, count)
            self.peak_bytes = max(self.peak_bytes, size)

    def require(self, p: int, what: str) -> None:
        """Raise ``ResidencyError`` unless partition ``p`` is resident (``what`` needs it)."""
        if p not in self.resident:
            raise ResidencyError(f"rank {self.rank}: {what} needs partition {p}, which is not "
                                 f"resident (resident: {_names(self.resident)})")

    # -- moving ------------------------------------------------------------------------------
    def switch(self, keep: Iterable[int]) -> Moved:
        """Make exactly the partitions ``keep`` resident: evict the others first, then load
        those of ``keep`` that are not resident."""
        keep = set(keep)
        bad = sorted(q for q in keep if not 0 <= q < self.partitions)
        if bad:
            raise ValueError(f"rank {self.rank}: no partition {bad[0]} (there are "
                             f"{self.partitions})")
        evicted = self._evict(self.resident - keep)
        loaded, devices = 0, set()
        for p in sorted(keep - self.resident):
            n, d = self._load(p)
            loaded, devices = loaded + n, devices | d
        _sync(devices)
        return Moved(evicted, loaded)

    def load_all(self) -> int:
        """Load every partition; the bytes loaded."""
        return self.switch(range(self.partitions)).loaded

    def _evict(self, parts: set[int]) -> int:
        """Evict the partitions ``parts`` (their storages that no partition staying resident
        uses); the bytes copied out."""
        if not parts:
            return 0
        self.resident -= parts
        needed = {_ptr(t) for q in self.resident for _, t in self.tensors(q)}
        blocks: dict[int, dict[int, torch.Tensor]] = {}
        for q in sorted(parts):
            for _, t in self.tensors(q):
                ptr = _ptr(t)
                if ptr and ptr not in needed:
                    blocks.setdefault(ptr, {})[id(t)] = t
        stored = []
        for ts in blocks.values():
            storage = next(iter(ts.values())).untyped_storage()
            data = torch.empty(storage.nbytes(), dtype=torch.uint8,
                               pin_memory=storage.device.type == "cuda")
            data.copy_(_as_bytes(storage), non_blocking=True)
            stored.append((storage, _Block(list(ts.values()), data)))
        _sync({s.device for s, _ in stored})  # the copies are done before the bytes go
        for storage, block in stored:
            storage.resize_(0)
            for t in block.tensors:
                self._evicted[id(t)] = block
        return sum(b.data.numel() for _, b in stored)

    def _load(self, p: int) -> tuple[int, set[torch.device]]:
        """Load partition ``p``: the bytes copied in and the devices they went to (their
        copies may still run: :func:`_sync` waits for them)."""
        moved, devices = 0, set()
        for name, t in self.tensors(p):
            block = self._evicted.get(id(t))
            if block is not None:
                storage = t.untyped_storage()
                storage.resize_(block.data.numel())
                _as_bytes(storage).copy_(block.data, non_blocking=True)
                for u in block.tensors:
                    del self._evicted[id(u)]
                moved += block.data.numel()
                devices.add(storage.device)
            elif t.numel() and not t.untyped_storage().nbytes():
                raise ResidencyError(f"rank {self.rank} cannot load partition {p}: {name} holds "
                                     "no data and the store has no copy of it")
        self.resident.add(p)
        return moved, devices


def _names(parts: Iterable[int]) -> str:
    return ", ".join(map(str, sorted(parts))) or "none"
