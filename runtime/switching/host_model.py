"""Host copies of a registered model: its weights, layer group by layer group, in shared memory
(pinned on a GPU), the source of pipelined transmission and where a preempted job's state goes.

:class:`HostModel` holds one contiguous ``uint8`` buffer per layer group of a graph grouped by
the ``layer_groups`` pass (the groups of :func:`tidal.runtime.weight_loader.group_tensors`), each
tensor at a 64-byte aligned offset. The buffers are shared-memory tensors, so every worker
process sees the same bytes: :meth:`~HostModel.transmit` copies group ``k`` into a destination
(a slice of the arena) and points the group's tensors of a worker's graph at views of it;
:meth:`~HostModel.save` copies a job's current tensors back (task cleaning of a training job),
so the next activation resumes from them bit for bit.

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

from dataclasses import dataclass

import torch
import torch.fx as fx

from tidal.runtime.switching.arena import round_up
from tidal.runtime.switching.stack import TENSOR_ALIGN
from tidal.runtime.weight_loader import group_tensors
from tidal.runtime.weight_store import TensorSpec, view_tensor


@dataclass(frozen=True)
class HostModel:
    """Per layer group a shared ``uint8`` buffer (``buffers[k]``) and where each tensor lies in
    it (``layout[k]``: ``(spec, byte offset)``). Build with :meth:`of`."""

    buffers: tuple[torch.Tensor, ...]
    layout: tuple[tuple[tuple[TensorSpec, int], ...], ...]

    @classmethod
    def of(cls, gm: fx.GraphModule, pin: bool = False) -> "HostModel":
        """The host copy of ``gm``'s current weights (``gm`` grouped by the ``layer_groups``
        pass). ``pin``: page-lock the buffers too (for a GPU's DMA)."""
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
            if pin:  # pragma: no cover - needs a GPU
                torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
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
