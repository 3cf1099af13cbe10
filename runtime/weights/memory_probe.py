"""Measured memory of a region of training: the peak of the activation bytes autograd keeps for
backward, the training state, and (on CUDA) the allocator's peak.

:class:`MemoryProbe` is a context manager. Inside it, a pack hook of
``torch.autograd.graph.saved_tensors_hooks`` adds the bytes of each tensor autograd saves for
backward, counting each storage once however many saved tensors (views, repeats) share it, and
a ``weakref.finalize`` on the saved tensor (on the object the pack hook hands autograd in its
place, so that the caller's own references do not matter) takes the bytes off again when
autograd frees it; the storage leaves the count when the last saved tensor on it is freed.
``peak_bytes`` is the highest live count during the region: the activation peak of the
schedule that ran in it (a pipeline that runs all forwards before the backwards keeps every
micro-batch's activations at once; 1F1B keeps a few). Parameters, buffers (of the modules
given) and views of any ``nn.Parameter`` are state, not activations, and are not counted; the
inputs are counted when a layer saves them (the whole storage: a slice of a batch counts the
batch).

Saved-tensor hooks are thread-local: the probe sees the autograd forwards run by the thread that
entered it (the caller's thread; the backward may run anywhere). Work run on other threads
(tidal's CPU stream workers, which run the round_robin and tick_tock programs) or without
autograd (a captured joint graph computes its own gradients) saves nothing it can see
(``saves`` stays 0). For that, ``host=True`` also samples the process's heap in use (glibc's
``mallinfo2``: every thread's allocations, tensors and Python objects alike) every
``interval_s`` seconds on a thread of its own and at each save, and reports the highest rise
above the level at entry (``heap_peak_bytes``; ``None`` off glibc; a sampled peak, so a rise
shorter than the interval may be missed). On CUDA ``cuda_peak_bytes`` is
``torch.cuda.max_memory_allocated`` over the region (the peak statistics are reset at entry).

:func:`state_bytes` is the training state a module holds: parameters, buffers, gradients and
the optimizer's state tensors, each storage once.

Example:
    >>> import torch
    >>> from tidal.runtime.weights.memory_probe import MemoryProbe, state_bytes
    >>> m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    >>> x, y = torch.randn(32, 64), torch.zeros(32, dtype=torch.long)
    >>> with MemoryProbe(m) as probe:
    ...     loss = torch.nn.functional.cross_entropy(m(x), y)
    ...     at_loss = probe.live_bytes
    ...     loss.backward()
    >>> probe.peak_bytes == at_loss > 0 and probe.live_bytes == 0
    True
    >>> probe.peak_bytes >= 32 * 256 * 4        # the ReLU's output, kept for both backwards
    True
    >>> opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    >>> opt.step()
    >>> state_bytes(m, opt) == 3 * sum(p.numel() * 4 for p in m.parameters())  # p, grad, momentum
    True
    >>> with MemoryProbe(m) as idle, torch.no_grad():
    ...     _ = m(x)
    >>> idle.peak_bytes, idle.saved_bytes
    (0, 0)
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
import weakref
from typing import Any, Optional, Union

import torch

from tidal.ir.memory_fit import state_bytes, storage_key

__all__ = ["MemoryProbe", "heap_bytes", "state_bytes"]

MIB = 2 ** 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2() -> Any:
    """glibc's ``mallinfo2`` (None where it is missing), looked up on first use."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn



def heap_bytes() -> Optional[int]:
    """Bytes the process's C heap has handed out and not freed (glibc ``mallinfo2``: arena
    chunks in use plus ``mmap``-ed blocks; every thread's tensors and Python objects), or None
    where glibc's ``mallinfo2`` is not available."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return int(info.uordblks + info.hblkhd)


class _Saved:
    """What autograd keeps for one saved tensor while the probe runs: the tensor, in an object
    only autograd refers to, so its finalizer runs when autograd frees the saved tensor (however
    long the caller keeps the tensor itself, as the model's input)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _unpack(held: Any) -> torch.Tensor:
    return held.tensor if isinstance(held, _Saved) else held


class MemoryProbe:
    """Measures a region's activation peak (see the module docstring); use it as a context
    manager, once or again (each ``with`` starts from zero).

    ``exclude``: modules whose parameters and buffers (and tensors whose storages) are not
    activations; any ``nn.Parameter`` and view of one is excluded anyway. ``host``: also sample
    the process heap (``heap_peak_bytes``). ``device``: the CUDA device for ``cuda_peak_bytes``
    (default: the current one, when CUDA is initialised).

    After (or during) the region: ``live_bytes`` the saved activation bytes live now,
    ``peak_bytes`` the highest ``live_bytes`` was, ``saved_bytes`` the bytes saved in the whole
    region (each storage each time it enters the count: the sum over the schedule), ``saves``
    how many tensors were saved (excluded ones too), ``heap_peak_bytes`` and
    ``cuda_peak_bytes`` (None when not measured; ``cuda_start_bytes`` the allocated bytes at
    entry)."""

    def __init__(self, *exclude: Union[torch.nn.Module, torch.Tensor], host: bool = False,
                 interval_s: float = 2e-4, device: Optional[Union[int, str, torch.device]] = None):
        self.exclude = exclude
        self.host = host
        self.interval_s = float(interval_s)
        self.device = device
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._generation = getattr(self, "_generation", 0) + 1   # finalizers of an earlier
        self.live_bytes = 0                                          # region are ignored
        self.peak_bytes = 0
        self.saved_bytes = 0
        self.saves = 0
        self.heap_peak_bytes: Optional[int] = None
        self.cuda_peak_bytes: Optional[int] = None
        self.cuda_start_bytes: Optional[int] = None
        self._refs: dict[int, list[int]] = {}   # data_ptr -> [saved tensors alive, bytes]
        self._constant: set[int] = set()
        self._hooks: Any = None
        self._sampler: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._heap0 = 0
        self._heap_max = 0

    # -- saved activations ----------------------------------------------------------------------
    def _constants(self) -> set[int]:
        ptrs: set[int] = set()
        for item in self.exclude:
            tensors = ([item] if isinstance(item, torch.Tensor) else
                       list(item.parameters()) + list(item.buffers()))
            for t in tensors:
                key = storage_key(t)
                if key is not None:
                    ptrs.add(key[0])
        return ptrs

    def _pack(self, t: torch.Tensor) -> Any:
        self.saves += 1
        if self._sampler is not None:   # the caller's forward grows the heap: read it here too
            self._sample()
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return t
        key = storage_key(t)
        if key is None or key[0] in self._constant:
            return t
        ptr, nbytes = key
        with self._lock:
            entry = self._refs.get(ptr)
            if entry is None:
                self._refs[ptr] = [1, nbytes]
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                self.saved_bytes += nbytes
            else:
                entry[0] += 1
        held = _Saved(t)
        weakref.finalize(held, self._release, ptr, self._generation)
        return held

    def _release(self, ptr: int, generation: int) -> None:
        with self._lock:
            entry = self._refs.get(ptr) if generation == self._generation else None
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                self.live_bytes -= entry[1]
                del self._refs[ptr]

    # -- heap sampling ----------------------------------------------------------------------------
    def _sample(self) -> None:
        now = heap_bytes()
        if now is not None:
            self._heap_max = max(self._heap_max, now)

    def _sampler_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    # -- context ----------------------------------------------------------------------------------
    def __enter__(self) -> "MemoryProbe":
        self._reset()
        self._constant = self._constants()
        if self.host and heap_bytes() is not None:
            self._heap0 = self._heap_max = heap_bytes() or 0
            self._sampler = threading.Thread(target=self._sampler_loop, daemon=True,
                                             name="tidal-memory-probe")
            self._sampler.start()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            dev = self.device if self.device is not None else torch.cuda.current_device()
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            self.cuda_start_bytes = int(torch.cuda.memory_allocated(dev))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        if self.cuda_start_bytes is not None:
            dev = self.device if self.device is not None else torch.cuda.current_device()
            torch.cuda.synchronize(dev)
            self.cuda_peak_bytes = int(torch.cuda.max_memory_allocated(dev))
        if self._sampler is not None:
            self._sample()
            self._stop.set()
            self._sampler.join()
            self._sampler = None
            self.heap_peak_bytes = self._heap_max - self._heap0

    def summary(self) -> str:
        """One line: the activation peak, distinct bytes saved, and the heap and CUDA peaks
        when measured."""
        parts = [f"saved activations: peak {self.peak_bytes / MIB:.2f} MiB, "
                 f"{self.saved_bytes / MIB:.2f} MiB saved in all ({self.saves} tensors)"]
        if self.heap_peak_bytes is not None:
            parts.append(f"heap peak +{self.heap_peak_bytes / MIB:.2f} MiB")
        if self.cuda_peak_bytes is not None:
            parts.append(f"CUDA max allocated {self.cuda_peak_bytes / MIB:.2f} MiB")
        return "; ".join(parts)


