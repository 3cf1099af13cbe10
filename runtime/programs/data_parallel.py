"""Plain data parallelism as a program: gradient all-reduces that overlap the rest of backward.

See :class:`DataParallelProgram`; the program itself is ``tidal.runtime.program.data_parallel``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from tidal.ir.capture import TrainStep, capture_train_step
from tidal.ir.comm_cost import DDP_BUCKET_BYTES
from tidal.ir.cost import example_batch
from tidal.ir.errors import TraceError
from tidal.ir.node_runner import flat_tensors
from tidal.runtime.data_parallel import broadcast_state, shard
from tidal.runtime.program import PieceTrace, Program, ProgramRunner, data_parallel


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class DataParallelProgram:
    """``Compiled.step`` as a data-parallel program: each rank captures the joint
    forward+backward graph of its shard of the global batch once per input shape
    (``tidal.ir.capture.capture_train_step`` of the graph module, which shares the model's
    parameters), builds :func:`data_parallel` with gradient
    all-reduces that overlap the rest of backward, and runs it with a :class:`ProgramRunner`;
    the loss returned is the global batch's (the mean of the shards'). ``last_trace`` holds the
    pieces of the latest step (:func:`chrome_trace` writes them). A step whose graph cannot be
    captured (data-dependent control flow, host syncs) runs through ``fallback`` (an executor
    with the same semantics), and ``fallback_reason`` says why."""

    def __init__(self, bucket_bytes: float = DDP_BUCKET_BYTES, fallback: Any = None):
        self.bucket_bytes = bucket_bytes
        self.fallback = fallback
        self.fallback_reason = ""
        self.last_trace: list[PieceTrace] = []
        self._steps: dict[tuple, tuple[TrainStep, Program]] = {}
        self._runner: Optional[ProgramRunner] = None
        self._started = False

    def __getattr__(self, name: str) -> Any:
        """What the program does not define (``compressor``, ``state_dict``) is the
        fallback executor's."""
        fallback = self.__dict__.get("fallback")
        if fallback is None:
            raise AttributeError(name)
        return getattr(fallback, name)

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """Inference is not distributed: every rank runs the whole batch."""
        return gm(*args, **kwargs)

    def step(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        if self.fallback_reason:
            return self.fallback.step(gm, model, inputs, targets, loss_fn, optimizer)
        rank, size = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
        batch = example_batch(inputs)
        if batch % size:
            raise ValueError(f"data parallel: global batch {batch} does not split evenly over "
                             f"{size} ranks")
        broadcast_state(model, params=not self._started)  # as DataParallelExecutor does
        self._started = True
        local = shard(inputs, rank, size, batch)
        local_targets = shard(targets, rank, size, batch)
        key = tuple((tuple(t.shape), t.dtype) for t in flat_tensors((local, local_targets)))
        if key not in self._steps:
            try:
                step = capture_train_step(gm, local, local_targets, loss_fn)
            except TraceError as e:
                if self.fallback is None:
                    raise
                self.fallback_reason = str(e)
                return self.fallback.step(gm, model, inputs, targets, loss_fn, optimizer)
            self._steps[key] = (step, data_parallel(step, size, self.bucket_bytes))
            first = True
        else:
            first = False
        step, program = self._steps[key]
        if self._runner is None:
            self._runner = ProgramRunner()
        optimizer.zero_grad(set_to_none=True)
        try:  # gm shares the model's parameters
            loss, _, self.last_trace = self._runner(program, step, gm, local, local_targets,
                                                    optimizer)
        except Exception as e:  # noqa: BLE001 - a first replay that fails falls back, named
            if not first or self.fallback is None:
                raise
            self.fallback_reason = f"the captured step failed to run: {type(e).__name__}: {e}"
            return self.fallback.step(gm, model, inputs, targets, loss_fn, optimizer)
        return loss
