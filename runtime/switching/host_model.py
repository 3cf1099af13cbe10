"""Host copies of a registered model: its weights, layer group by layer group, in shared memory
(page-locked on a GPU by each worker that copies from them), the source of pipelined
transmission and where a preempted job's state goes.

:class:`HostModel` holds one contiguous ``uint8`` buffer per layer group of a graph grouped by
the ``layer_groups`` pass (the groups of :func:`tidal.runtime.weights.loader.group_tensors`), each
tensor at a 64-byte aligned offset. The buffers are shared-memory tensors, so every worker
process sees the same bytes: :meth:`~HostModel.transmit` copies group ``k`` into a destination
(a slice of the arena) and points the group's tensors of a worker's graph at views of it;
:meth:`~HostModel.save` copies a job's current tensors back (task cleaning of a training job),
so the next activation resumes from them bit for bit.

Page-locking is per process: a worker that receives the shared buffers registers them itself
(:meth:`HostModel.page_lock`, ``cudaHostRegister``) before copying from them to a GPU, checks the
return code and unregisters them when it stops (:class:`PageLock`). A buffer that cannot be
registered is named in ``PageLock.failures`` (and a warning) and its copies run unpinned
(slower, synchronous), never silently.

Example:
    >>> import torch, tidal
    >>> from tidal.passes.layer_groups import LayerGroups
    >>> from tidal.runtime.switching.host_model import HostModel
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> c = tidal.compile(m, (torch.randn(3, 4),), passes=[LayerGroups(grouping="per_layer")])
    >>> host = HostModel.of(c.graph_module)
    >>> host.num_groups, host.group_nbytes(0), host.buffers[0].is_shared()
    (3, 128, True)
    >>> gm = c.graph_module
    >>> dst = torch.empty(host.group_nbytes(2), dtype=torch.uint8)
    >>> host.transmit(2, gm, dst)
    >>> gm.get_parameter("2.weight").data_ptr() == dst.data_ptr()
    True
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from tidal.runtime.switching.arena import round_up
from tidal.runtime.switching.stack import TENSOR_ALIGN
from tidal.runtime.weights.loader import group_tensors
from tidal.runtime.weights.store import TensorSpec, view_tensor


@dataclass(frozen=True)
class HostModel:
    """Per layer group a shared ``uint8`` buffer (``buffers[k]``) and where each tensor lies in
    it (``layout[k]``: ``(spec, byte offset)``). Build with :meth:`of`."""

    buffers: tuple[torch.Tensor, ...]
    layout: tuple[tuple[tuple[TensorSpec, int], ...], ...]

    @classmethod
    def of(cls, gm: fx.GraphModule) -> "HostModel":
        """The host copy of ``gm``'s current weights (``gm`` grouped by the ``layer_groups``
        pass), in shared memory (page-lock it in the process that copies from it:
        :meth:`page_lock`)."""
        buffers, layout = [], []
        for group in group_tensors(gm):
            entries, at = [], 0
            for name, t in group:
                spec = TensorSpec.of(name, t)
                at = round_up(at, TENSOR_ALIGN)
                entries.append((spec, at))
                at += spec.nbytes
            buf = torch.zeros(round_up(max(at, 1), TENSOR_ALIGN), dtype=torch.uint8)
            buf.share_memory_()
            for (spec, off), (_, t) in zip(entries, group):
                view_tensor(buf, spec, off).copy_(t.detach())
            buffers.append(buf)
            layout.append(tuple(entries))
        return cls(tuple(buffers), tuple(layout))

    @property
    def num_groups(self) -> int:
        return len(self.buffers)

    def group_nbytes(self, k: int) -> int:
        return self.buffers[k].numel()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def _targets(self, gm: fx.GraphModule, k: int) -> list[torch.Tensor]:
        return [_tensor(gm, spec.name) for spec, _ in self.layout[k]]

    def transmit(self, k: int, gm: fx.GraphModule, dst: torch.Tensor,
                 non_blocking: bool = False) -> None:
        """Copy group ``k`` into ``dst`` (a ``uint8`` tensor of :meth:`group_nbytes`) and point
        the group's parameters and buffers of ``gm`` at views of it."""
        dst.copy_(self.buffers[k], non_blocking=non_blocking)
        for (spec, off), t in zip(self.layout[k], self._targets(gm, k)):
            t.data = view_tensor(dst, spec, off)

    def save(self, gm: fx.GraphModule) -> None:
        """Copy ``gm``'s current weights back into the host buffers (bit for bit)."""
        for k in range(self.num_groups):
            for (spec, off), t in zip(self.layout[k], self._targets(gm, k)):
                view_tensor(self.buffers[k], spec, off).copy_(t.detach())

    def page_lock(self, what: str, warn: bool = True) -> "PageLock":
        """Page-lock the buffers in this process (``cudaHostRegister``) for a GPU's DMA;
        ``what`` names this host copy in the failures (e.g. ``"job 'bert'"``)."""
        return PageLock(self.buffers, [f"host copy of {what}, group {k}"
                                       for k in range(self.num_groups)], warn=warn)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor as a view of the host buffers, by name."""
        return {spec.name: view_tensor(self.buffers[k], spec, off)
                for k in range(self.num_groups) for spec, off in self.layout[k]}


def _tensor(gm: fx.GraphModule, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` of ``gm``."""
    try:
        return gm.get_parameter(name)
    except AttributeError:
        return gm.get_buffer(name)


def cuda_error(cudart: Any, code: Any) -> Optional[str]:
    """None if ``code`` (a CUDA runtime call's return code) is ``cudaSuccess``, else its number
    and text."""
    number = int(code)
    if number == 0:
        return None
    try:
        text = cudart.cudaGetErrorString(code)
    except Exception:  # noqa: BLE001 - the number alone still names it
        text = "no description"
    return f"CUDA error {number} ({text})"


class PageLock:
    """``buffers`` (named ``names``) registered with ``cudaHostRegister`` in this process; a
    non-zero return code leaves that buffer pageable and is reported in ``failures`` (and a
    ``RuntimeWarning`` when ``warn``). :meth:`close` unregisters what was registered.

    Example (on the CPU, with a stand-in for ``torch.cuda.cudart()``):
        >>> import torch
        >>> from tidal.runtime.switching.host_model import PageLock
        >>> class OutOfMemory:
        ...     def cudaHostRegister(self, ptr, size, flags): return 2
        ...     def cudaGetErrorString(self, code): return "out of memory"
        >>> lock = PageLock([torch.zeros(64, dtype=torch.uint8)], ["group 0"], warn=False,
        ...                 cudart=OutOfMemory())
        >>> lock.failures, lock.locked
        (['group 0: cudaHostRegister failed: CUDA error 2 (out of memory); its copies ...'], [])
    """

    def __init__(self, buffers: Sequence[torch.Tensor], names: Sequence[str], *,
                 warn: bool = True, cudart: Any = None):
        self.cudart = cudart if cudart is not None else torch.cuda.cudart()
        self.warn = warn
        self.locked: list[tuple[str, torch.Tensor]] = []
        self.failures: list[str] = []
        for name, buf in zip(names, buffers):
            code = self.cudart.cudaHostRegister(buf.data_ptr(),
                                                buf.numel() * buf.element_size(), 0)
            error = cuda_error(self.cudart, code)
            if error is None:
                self.locked.append((name, buf))
            else:
                self._fail(f"{name}: cudaHostRegister failed: {error}; its copies run "
                           "unpinned (slower, synchronous)")

    def _fail(self, note: str) -> None:
        self.failures.append(note)
        if self.warn:
            warnings.warn(note, RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        """Unregister every registered buffer (no copy from them may still be running)."""
        for name, buf in self.locked:
            error = cuda_error(self.cudart, self.cudart.cudaHostUnregister(buf.data_ptr()))
            if error is not None:
                self._fail(f"{name}: cudaHostUnregister failed: {error}")
        self.locked = []
