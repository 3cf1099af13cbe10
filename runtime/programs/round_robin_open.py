"""The open step (``Compiled.backward``, as DDP's) of a round-robin program: the same schedule
with no update, the gradients added to ``.grad``.

:class:`RoundRobinBackward` binds the program ``tidal.ir.round_robin_program`` lays out for the
open step (``finish``: no ``U`` piece; with a process group a partition is kept resident only
while its compute or its all-reduce needs it). When it is bound, the ``.grad`` the loop holds
(what earlier calls added) is set aside, so that ``F``/``B`` accumulate this call's gradient
alone in ``.grad``, as the closed step does after ``zero_grad``. ``F``/``B`` compute the
gradients of ``scale *`` the loss (``scale``: a number, a ``GradScaler``'s scale tensor or
None): the last partition's backward is seeded with it (``round_robin_compute``), as eager
``scaler.scale(loss).backward()`` does, so fp16 intermediate gradients do not underflow. Then:

- with ``sync``, ``A p`` adds to partition p's gradient what calls inside ``no_sync``
  accumulated for it (the program's ``LocalGrads``) and all-reduces the sum over
  the ranks (the N micro-batches' sum: the gradient of ``scale *`` the global batch's mean
  loss); the last piece, ``grads``, runs after the ``restore`` (every partition, gradients
  included, loaded back) and adds what was set aside: ``.grad`` is what it was plus this
  call's synchronized gradient, whole on every rank, as after DDP's backward;
- inside ``no_sync`` (``sync`` False) nothing is all-reduced: ``buffers p`` only averages the
  partition's floating-point buffers (every rank ran it on its own batch) and the last piece,
  ``accumulate``, moves this call's gradient (of ``scale *`` the loss) into the program's
  ``LocalGrads`` and gives ``.grad`` back what was set aside.

In one process (every rank's pieces here) there is no all-reduce: ``.grad`` accumulates the N
micro-batches' gradients and the result is the same. Returns the global batch's loss (the sum of
the micro-batch losses / N), unscaled.

Example:
    >>> import torch, tidal
    >>> from tidal.passes.round_robin import RoundRobin
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> x, y = torch.randn(4, 4), torch.tensor([0, 1, 1, 0])
    >>> c = tidal.compile(model, (x,), passes=[RoundRobin(partitions=2)],
    ...                   loss_fn=torch.nn.functional.cross_entropy)
    >>> with c.no_sync():
    ...     _ = c.backward(x, y, scale=0.5)
    >>> model[0].weight.grad is None, [p.name for p in c.executor.last_program.pieces][-1]
    (True, 'accumulate')
    >>> _ = c.backward(x, y, scale=0.5)                  # the two halves: one whole gradient
    >>> ref = torch.func.functional_call(model, dict(model.named_parameters()), (x,))
    >>> want = torch.autograd.grad(torch.nn.functional.cross_entropy(ref, y), model[0].weight)[0]
    >>> torch.allclose(model[0].weight.grad, want, atol=1e-6)
    True
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from tidal.ir.round_robin_program import Slot
from tidal.runtime.programs.optimizer_wiring import LocalGrads, accumulate_grad
from tidal.runtime.programs.replica_sync import average_buffers
from tidal.runtime.programs.round_robin_step import RoundRobinStep


class RoundRobinBackward(RoundRobinStep):
    """One open step of a ``RoundRobinProgram`` bound to its tensors (see the module
    docstring): ``scale`` seeds the loss's backward, ``sync`` False keeps the gradient in
    ``local`` (the program's :class:`~tidal.runtime.programs.optimizer_wiring.LocalGrads`)."""

    counts_step = False  # no optimizer step: the loop takes it

    def __init__(self, *args: Any, scale: Any, sync: bool, local: LocalGrads):
        super().__init__(*args, optimizer=None)
        self.scale, self.sync, self.local = scale, sync, local
        # what .grad held before this call: set aside, so that F/B accumulate this call's alone
        self._aside: list[tuple[str, torch.Tensor, Any]] = []
        for part in self.parts.owned:
            for name, param in part:
                self._aside.append((name, param, param.grad))
                param.grad = None

    def actions(self) -> dict[str, Callable[[Slot], None]]:
        return {**super().actions(), "G": self._finish}

    def _all_reduce(self, slot: Slot) -> None:
        """Partition p's gradient (of ``scale * loss``) plus what ``no_sync`` calls kept for
        it, summed over the ranks; inside ``no_sync`` only its buffers are averaged."""
        p = slot.partition
        if not self.sync:
            if self.world > 1:
                average_buffers(self.parts.buffers[p])
            return
        named = [(k, prm) for k, prm in self.parts.owned[p] if prm.grad is not None]
        for _, prm in named:
            prm.grad = self.local.plus(prm, prm.grad)
        if self.world > 1:
            self.sync_partition(p, named)

    def _finish(self, slot: Slot) -> None:
        """The last piece (every partition resident): ``grads`` adds what was set aside to
        this call's synchronized gradient; ``accumulate`` keeps this call's gradient in
        ``local`` and puts back what was set aside."""
        for name, param, aside in self._aside:
            fresh, param.grad = param.grad, aside
            if fresh is None:
                continue
            if self.sync:
                accumulate_grad(param, fresh)
            else:
                self.local.add(name, param, fresh)
        if self.sync:
            self._add_left()

    def _add_left(self) -> None:
        """What ``no_sync`` calls kept for a parameter this call gave no gradient: added in one
        process; refused on several ranks (it was not all-reduced with its partition)."""
        left = self.local.drain()
        if left and self.world > 1:
            raise ValueError(f"round_robin: gradients of {[n for n, _, _ in left][:3]} were "
                             f"accumulated inside no_sync() but this synchronized "
                             f"Compiled.backward gives them none (unused in this batch, or "
                             f"frozen in between?): keep the parameters that train the same "
                             f"over an accumulation")
        for _, param, grad in left:
            if param.requires_grad:
                accumulate_grad(param, grad)
