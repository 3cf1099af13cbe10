"""What a burst-parallel rank's transfers carry: the dtype and trailing shape of every value of
the graph on the step's inputs under the step's autocast state (:func:`produced`), and the check
that a transfer's input has them before any row moves (:class:`TransferChecker`).

A ``tidal::scatter``/``gather`` receives into buffers of the receiving rank's own dtype and
trailing shape, so every rank must hand the transfer the same kind of tensor. A rank that runs
a layer gets it from the layer (under bf16 autocast a ``Linear`` gives bfloat16); a rank that
skips it (``tidal.runtime.programs.burst_graph.skipped_layer``) must make an empty tensor of
what the layer *would* give under the same autocast. :func:`produced` tells: it runs the graph
on fake tensors (nothing computes, no parameter, buffer or input changes) with every transfer
as the identity — the one-process semantics, which every rank that runs a layer follows, with
all rows, so no code meets an empty batch — under the autocast state the step was bound in.
Every rank computes the same facts from the same kind of step (input shapes and dtypes,
autocast state), which the ranks check once per kind with one all-reduce (:func:`agree`). The
gradients need nothing more: autograd hands each transfer's backward a gradient of its forward
output's dtype and shape.

Ranks that bind different kinds of step, or a rank whose value still differs from the facts,
raise :class:`TransferMismatchError` naming the rank (and the transfer, both kinds of tensor)
before any row moves: a mismatched point-to-point message would abort the process.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.runtime.programs.piece_autocast import NO_AUTOCAST
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()))
    >>> bf16 = (("cpu", True, "bfloat16"),)
    >>> produced(gm, (torch.randn(4, 3),), bf16).nodes["_1"]
    Produced(tail=(2,), dtype=torch.bfloat16)
    >>> produced(gm, (torch.randn(4, 3),), NO_AUTOCAST).nodes["_1"].dtype
    torch.float32
"""
from __future__ import annotations

import zlib
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from tidal.ir.burst_sync import is_transfer
from tidal.ir.collectives import rows_like
from tidal.ir.errors import TidalError
from tidal.runtime.distributed import collective_device
from tidal.runtime.programs.piece_autocast import AutocastState, autocast_as


class Produced(NamedTuple):
    """What a node gives on the global batch: its shape after the batch dimension (``tail``)
    and its ``dtype``."""

    tail: tuple[int, ...]
    dtype: torch.dtype


class TransferMismatchError(TidalError):
    """A rank's input to a ``tidal::scatter``/``gather`` is not the dtype or trailing shape
    every rank expects, the ranks expect different ones, or what a skipping rank must hand it
    cannot be told: raised before the transfer (a mismatched message would abort the
    process)."""


class Facts(NamedTuple):
    """What :func:`produced` found: per node name, what it gives (``nodes``), and the node
    fake tensors could not run, with the error (``failed``; '' when every node ran)."""

    nodes: dict[str, Produced]
    failed: str


class _Identity(fx.Interpreter):
    """Runs a graph with every transfer (and ``tidal.ir.collectives.rows_like``, a stand-in
    for another GPU set's rows) as the identity, as on one process, recording what each node
    that gives one tensor produced (``seen``)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.seen: dict[str, Produced] = {}
        self.failed = ""

    def run_node(self, n: fx.Node) -> Any:
        if is_transfer(n) or (n.op == "call_function" and n.target is rows_like):
            out = self.env[n.args[0]]
        else:
            try:
                out = super().run_node(n)
            except Exception as e:
                first = (str(e).strip().splitlines() or [""])[0][:200]
                self.failed = f"node {n.name!r}: {type(e).__name__}: {first}"
                raise
        if isinstance(out, torch.Tensor) and out.dim() > 0 and n.op != "output":
            self.seen[n.name] = Produced(tuple(out.shape[1:]), out.dtype)
        return out


class _Propagation(torch.nn.Module):
    """``gm`` run by :class:`_Identity` (a module, so ``functional_call`` can put fake
    parameters and buffers in place of the real ones while it runs)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__()
        self.gm = gm
        self.runner = _Identity(gm)

    def forward(self, *args: Any) -> Any:
        return self.runner.run(*args)


def produced(gm: fx.GraphModule, inputs: Sequence[Any], autocast: AutocastState) -> Facts:
    """Per node of ``gm`` that gives one tensor (of at least one dimension), what it gives on
    ``inputs`` (the global batch) under ``autocast`` (``tidal.ir.step_state.autocast_state``
    of the thread that binds the step), with every transfer as the identity: run on fake
    tensors, so nothing computes and no parameter, buffer or input changes. A node fake
    tensors cannot run (a data-dependent op) is named (``failed``) and the nodes from it on
    are left out.

    >>> import torch.fx as fx
    >>> gm = fx.symbolic_trace(torch.nn.Linear(3, 2))
    >>> produced(gm, (torch.randn(5, 3),), (("cpu", True, "bfloat16"),)).nodes["linear"]
    Produced(tail=(2,), dtype=torch.bfloat16)
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    module = _Propagation(gm)
    with mode, torch.no_grad():
        state = {f"gm.{n}": mode.from_tensor(t) for n, t in
                 list(gm.named_parameters(remove_duplicate=False)) +
                 list(gm.named_buffers(remove_duplicate=False))}
        fake = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in inputs]
        with autocast_as(autocast):
            try:
                torch.func.functional_call(module, state, tuple(fake))
            except Exception as e:  # noqa: BLE001 - the nodes seen before it stand
                failed = module.runner.failed or f"{type(e).__name__}: {e}"[:200]
                return Facts(module.runner.seen, failed)
    return Facts(module.runner.seen, "")


def expected_inputs(run: fx.GraphModule, facts: Facts, autocast: AutocastState
                    ) -> dict[str, Produced]:
    """Per transfer node of ``run`` (by name, as in the graph ``facts`` came from) whose kind
    :func:`produced` knows, what its input must be on every rank: what the transfer gives
    (the identity, on one process). Under autocast, a transfer it could not reach raises
    :class:`TransferMismatchError` (a skipping rank could not tell its dtype; without
    autocast the shapes recorded at compile time stand, as they are what the layer gives)."""
    moves = [n.name for n in run.graph.nodes if is_transfer(n)]
    unknown = [m for m in moves if m not in facts.nodes]
    if unknown and any(enabled for _, enabled, _ in autocast):
        raise TransferMismatchError(
            f"burst_parallel: under autocast, what transfer {unknown[0]!r} carries cannot be "
            f"told (fake tensors could not run {facts.failed}), so a rank that skips a layer "
            f"before it cannot make rows of the dtype the layer gives: run this step without "
            f"torch.autocast, or make that node traceable on fake tensors")
    return {m: facts.nodes[m] for m in moves if m in facts.nodes}


def agree(step_kind: tuple, group: Any = None) -> None:
    """Check, with one all-reduce over ``group``, that every rank binds the same kind of step
    (``step_kind``: the input shapes and dtypes and the autocast state,
    ``step_capture.shape_key``), from which every rank tells alike what the transfers carry;
    raise :class:`TransferMismatchError` on every rank when they differ (another autocast
    state or another batch on some rank). Run once per kind of step, before its first
    transfer."""
    summary = repr(step_kind)
    fingerprint = zlib.crc32(summary.encode())
    flags = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64,
                         device=collective_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if int(flags[0]) != -int(flags[1]):
        raise TransferMismatchError(
            f"burst_parallel: the ranks' steps differ in input shapes or autocast state, so "
            f"their transfers would carry different tensors (rank {dist.get_rank()}: "
            f"{summary[:300]}): run every rank's step on the same global batch, under the "
            f"same torch.autocast (or none)")


def check_transfer(name: str, value: Any, expected: Produced, rank: Optional[int]) -> None:
    """Raise :class:`TransferMismatchError` when ``value`` (this rank's input to transfer
    ``name``) is not of ``expected`` dtype and trailing shape.

    >>> check_transfer("gather_default", torch.zeros(2, 3), Produced((3,), torch.float32), 0)
    >>> try:
    ...     check_transfer("gather_default", torch.zeros(2, 3, dtype=torch.bfloat16),
    ...                    Produced((3,), torch.float32), 1)
    ... except TransferMismatchError as e:
    ...     print(str(e)[:72])
    burst_parallel: rank 1 would move 'gather_default' as bfloat16 rows of s
    """
    if not isinstance(value, torch.Tensor):
        return
    got = Produced(tuple(value.shape[1:]), value.dtype)
    if got != expected:
        raise TransferMismatchError(
            f"burst_parallel: rank {rank} would move {name!r} as {_show(got)} but the ranks "
            f"agreed on {_show(expected)} (the step's global batch under its autocast "
            f"state): run every rank's step on the same global batch, under the same "
            f"torch.autocast (or none); the transfer was not started")


def _show(facts: Produced) -> str:
    return f"{str(facts.dtype).replace('torch.', '')} rows of shape {list(facts.tail)}"


class TransferChecker(fx.Interpreter):
    """Runs a rank's graph, checking before each transfer named in ``expected`` that its input
    is of the agreed dtype and trailing shape (:func:`check_transfer`)."""

    def __init__(self, module: fx.GraphModule, expected: Mapping[str, Produced],
                 rank: Optional[int] = None):
        super().__init__(module)
        self.expected = dict(expected)
        self.rank = rank

    def run_node(self, n: fx.Node) -> Any:
        if n.name in self.expected and is_transfer(n):
            check_transfer(n.name, self.env.get(n.args[0]), self.expected[n.name], self.rank)
        return super().run_node(n)
