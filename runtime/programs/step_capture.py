"""Capture of a training step for a program, or the reason it runs eagerly: what every builder
that runs segments of the captured joint graph does once per input shape.

:func:`capture_step` traces the step (``tidal.ir.capture.capture_train_step``) and
:func:`lower_step` lowers and captures the program's segments of it
(``tidal.runtime.program.CapturedProgram``: CUDA graphs on a GPU, the straight-line replay on
the CPU) once per replica whose runs are alive at once (a wave, a rank of this process), each
on its own flat inputs, on copies, the random state kept. Either raises :class:`Fallback`, the
reason the step runs with autograd instead and the node at fault. A :class:`StepCapture` is the
outcome for one shape: the program and, when captured, the step and its lowered segments; its
``uncaptured`` lists what runs outside a captured segment, or why nothing does.
:func:`agreed` makes every rank take the same road. :func:`shape_key` is the cache key of a
shape and of the thread's autocast state: a capture traced inside ``torch.autocast`` records
its casts (``make_fx`` traces through autocast), so a step in another autocast state is
captured again, never replayed from the old capture; the captured segments run with autocast
off (their casts are in the graph: ``tidal.runtime.programs.piece_autocast``).

Example:
    >>> import torch
    >>> from tidal.ir.capture import step_inputs
    >>> from tidal.runtime.program import data_parallel
    >>> from tidal.runtime.backend import backend_for
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    >>> x, y = torch.randn(2, 4), torch.tensor([0, 2])
    >>> step = capture_step(model, (x,), y, torch.nn.functional.cross_entropy)
    >>> program = data_parallel(step, world=1)
    >>> capture = lower_step(step, program, {0: step_inputs(step, model, (x,), y)},
    ...                      backend_for(torch.device("cpu")))
    >>> capture.captured, capture.uncaptured
    (True, ())
    >>> key = shape_key((x,), y)
    >>> key[:2]
    (((2, 4), torch.float32), ((2,), torch.int64))
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):   # captured again under autocast
    ...     shape_key((x,), y) == key
    False
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from tidal.ir.capture import TrainStep, capture_train_step, failing_node, grad_nodes
from tidal.ir.errors import TraceError
from tidal.ir.node_runner import flat_tensors
from tidal.ir.program import Program
from tidal.ir.rng import fork_rng_of
from tidal.ir.step_state import autocast_state
from tidal.runtime.backend import Backend
from tidal.runtime.distributed import collective_device, group_size
from tidal.runtime.program import CapturedProgram, state_inputs
from tidal.runtime.programs.piece_autocast import NO_AUTOCAST, autocast_as

FAILED_TO_RUN = "the captured step failed to run: "


class Fallback(Exception):
    """Why a step runs with autograd instead of captured segments: ``reason``, and ``node``,
    the joint-graph node at fault ('-' when none is known)."""

    def __init__(self, reason: str, node: str = "-"):
        super().__init__(reason)
        self.reason, self.node = reason, node


@dataclass(frozen=True)
class StepCapture:
    """A training step for one input shape: its ``program`` and, when it runs captured, the
    joint graph (``step``) and its lowered segments per replica (``lowered``); ``uncaptured``
    is ``(node, reason)`` of what runs outside a captured segment, or of why the step runs
    eagerly."""

    program: Program
    step: Optional[TrainStep] = None
    lowered: Mapping[Hashable, CapturedProgram] = field(default_factory=dict)
    uncaptured: tuple[tuple[str, str], ...] = ()

    @property
    def captured(self) -> bool:
        """Whether the step runs captured segments."""
        return self.step is not None

    def nodes(self) -> tuple[Any, list[Any]]:
        """The loss node and each parameter's gradient node of the captured step."""
        return grad_nodes(self.step)

    @classmethod
    def eager(cls, program: Program, why: Fallback) -> "StepCapture":
        """The step that runs ``program`` with autograd, for the reason ``why``."""
        return cls(program, uncaptured=((why.node, why.reason),))


def capture_step(module: torch.nn.Module, inputs: Any, targets: Any,
                 loss_fn: Callable) -> TrainStep:
    """The joint forward+backward graph of a step of ``module``; raises :class:`Fallback`
    with the tracer's reason when it cannot be captured."""
    try:
        return capture_train_step(module, inputs, targets, loss_fn)
    except TraceError as e:
        raise Fallback(str(e)) from e


def lower_step(step: TrainStep, program: Program, flats: Mapping[Hashable, Sequence[Any]],
               backend: Backend) -> StepCapture:
    """``program``'s segments of ``step`` lowered and captured on ``backend``, once per
    replica of ``flats`` (its flat inputs: ``step_inputs``), on copies, consuming no
    randomness; the replicas' captures have memory pools of their own, so they replay at
    once. Raises :class:`Fallback` naming the node at fault when the captured step cannot
    run. Autocast is off meanwhile: the step's casts are in its graph."""
    with fork_rng_of(flats), autocast_as(NO_AUTOCAST):
        try:
            lowered = {key: CapturedProgram.build(program, step.gm, flat, backend,
                                                  state=state_inputs(step))
                       for key, flat in flats.items()}
        except Exception as e:  # noqa: BLE001 - the step runs eagerly, the node named
            failing = failing_node(step, next(iter(flats.values())))
            named = re.match(r"node '([^']+)'", failing)
            raise Fallback(FAILED_TO_RUN + (failing or f"{type(e).__name__}: {e}"),
                           named.group(1) if named else "-") from e
    first = next(iter(lowered.values()))
    return StepCapture(program, step, lowered, tuple(first.uncaptured()))


def shape_key(*values: Any) -> tuple:
    """``(shape, dtype)`` of every tensor in ``values``, then this thread's autocast state
    (``tidal.ir.step_state.autocast_state``): a step's cache key (a capture records the
    autocast casts it was traced under)."""
    return tuple((tuple(t.shape), t.dtype) for t in flat_tensors(values)) + (autocast_state(),)


def agreed(reason: str, group: Optional[dist.ProcessGroup] = None) -> str:
    """``reason`` (why this rank cannot run the captured step, '' when it can), or a reason of
    its own when another rank of ``group`` cannot: every rank runs the same program. A
    collective on more than one rank."""
    if group_size(group) == 1:
        return reason
    flag = torch.tensor([1 if reason else 0], dtype=torch.int32,
                        device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return reason or ("another rank cannot run the captured step" if flag.item() else "")
