"""What a pass is: the ``Pass`` base class, the context it runs in and the result it returns.

A pass is a class with a ``name``, a docstring, ``requires``/``ensures`` checks and
``__call__(gm, ctx) -> PassResult``. Ordering constraints are declared with ``after`` /
``before`` (names of other passes; a constraint on a pass that is not selected is ignored).
Passes never import each other; what they share lives in ``tidal.ir``.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir.pass_api import Pass, PassContext, PassResult
    >>> class CountNodes(Pass):
    ...     '''Counts nodes; changes nothing.'''
    ...     name = "count_nodes"
    ...     def __call__(self, gm, ctx):
    ...         return PassResult(gm, notes=(f"{len(gm.graph.nodes)} nodes",))
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> CountNodes()(gm, PassContext.for_inputs((torch.randn(1, 2),))).notes
    ('3 nodes',)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch
import torch.fx as fx

from tidal.ir.cluster import Cluster
from tidal.ir.errors import PassError
from tidal.ir.plan import Plan

BATCH_CONVENTIONS = ("global", "local")
"""How the ranks pass a training step's data (``compile(batch=)``): ``"global"``, every rank
the same global batch; ``"local"``, each rank its own local batch (a ``DistributedSampler``),
joined into the global batch in rank order by the runtime."""


@dataclass
class PassContext:
    """Everything a pass may read besides the graph.

    ``example_inputs`` and ``example_targets`` at the example batch, ``batch_size`` (the global
    batch), the ``cluster``, ``loss_fn``/``optimizer`` when compiling for training, the original
    ``model``, ``plans`` of the passes that ran before (by name) and ``log`` for progress lines.
    ``batch`` is how the ranks pass a step's data (one of :data:`BATCH_CONVENTIONS`; a pass
    always sees the global batch) and ``check_batch`` whether the runtime checks it every step
    (``tidal.runtime.batch_data.global_batch``).
    """

    example_inputs: tuple
    batch_size: int
    cluster: Cluster = field(default_factory=Cluster)
    model: Optional[torch.nn.Module] = None
    loss_fn: Optional[Callable] = None
    optimizer: Any = None
    example_targets: Any = None
    plans: dict[str, Plan] = field(default_factory=dict)
    log: Callable[[str], None] = lambda msg: None
    encode_decode_s: Optional[Callable[[str, Sequence[tuple[int, ...]]], float]] = None
    """Measures a gradient compressor on this machine: ``(spec, parameter shapes) -> seconds``
    of encode + decode (``compile()`` fills it from the runtime's compressors; a pass cannot
    import the runtime)."""
    batch: str = "global"
    check_batch: bool = True

    @classmethod
    def for_inputs(cls, example_inputs: Sequence[Any], **kw: Any) -> "PassContext":
        """A context for ``example_inputs`` with the batch size read from their first dim."""
        from tidal.ir.cost import example_batch

        inputs = tuple(example_inputs)
        return cls(example_inputs=inputs, batch_size=example_batch(inputs), **kw)


@runtime_checkable
class Executor(Protocol):
    """How a compiled model runs when a plan changes the schedule (multi-rank execution, waves,
    pipelined loading). The runtime builds it from the plans (``tidal.runtime.executors``);
    ``Compiled`` delegates to it.

    ``forward(gm, *args, **kwargs)`` runs inference; ``step(gm, model, inputs, targets,
    loss_fn, optimizer)`` runs one training step on the global batch (every rank passes the
    same global batch; the executor takes its share) and returns the loss.
    """

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any: ...

    def step(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> torch.Tensor: ...


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (possibly new) graph module, the plan it chose (or None for a
    pure rewrite), extra ``artifacts`` for dumps (file name -> text, e.g. an extra DOT or an SVG
    chart) and one-line ``notes`` for the report. How the result runs is the runtime's to
    decide, from the plan: a pass builds no executor."""

    gm: fx.GraphModule
    plan: Optional[Plan] = None
    artifacts: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


class Pass:
    """Base class of graph passes. Subclasses set ``name`` and implement ``__call__``.

    ``requires`` runs before the pass and ``ensures`` after it; each raises ``PassError`` (use
    ``self.fail(msg)``) when its condition does not hold. Constructor keyword arguments are the
    pass's options. ``training_only`` passes need ``loss_fn``. Passes with the same non-empty
    ``exclusive`` tag are alternatives (e.g. ways to parallelize the whole step): at most one
    may be selected, and ``passes="auto"`` keeps the first that applies. A pass whose training
    update is not the plain step on the batch sets ``changes_update`` to the reason (e.g. Wavelet's
    cross-wave averaging); ``passes="auto"`` never selects it and says so in the report.
    """

    name: ClassVar[str] = ""
    after: ClassVar[tuple[str, ...]] = ()
    before: ClassVar[tuple[str, ...]] = ()
    training_only: ClassVar[bool] = False
    exclusive: ClassVar[str] = ""
    changes_update: ClassVar[str] = ""

    def requires(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Check the pass's preconditions on the incoming graph; default: none."""

    def ensures(self, gm: fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        """Check the pass's postconditions on its result; default: none."""

    def applies(self, gm: fx.GraphModule, ctx: PassContext) -> bool:
        """Whether the pass has anything to do for this model and context (``passes="auto"``
        selects the passes for which this is true): true when ``why_not`` gives no reason."""
        return not self.why_not(gm, ctx)

    def why_not(self, gm: fx.GraphModule, ctx: PassContext) -> str:
        """Why the pass does not apply to this model and context, for the report of
        ``passes="auto"``; empty when it applies (default)."""
        return ""

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        raise NotImplementedError(f"pass {self.name!r} does not implement __call__")

    def fail(self, message: str) -> None:
        """Raise a ``PassError`` whose message starts with this pass's name."""
        raise PassError(f"pass {self.name!r}: {message}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
