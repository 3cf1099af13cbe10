"""The plan of the ``embedding_cache`` pass (Bagpipe): which embedding tables live on the
embedding servers, the keyword inputs through which the rewritten graph reads each one's working
set, and the Oracle Cacher's lookahead; with the two helpers the runtime needs around it.

The rewritten graph module takes the model's inputs plus, per cached table ``t``, the keyword
inputs ``t.ids_input`` (the batch's distinct ids of the table, sorted ascending) and
``t.rows_input`` (their rows, ``[n, dim]``). :func:`table_ids` computes each table's ids for a
batch by running only the part of the graph that derives them from the inputs (what the Oracle
Cacher needs to look ahead without running the model); :func:`working_set` turns ids and full
tables into those keyword inputs (tests and the "no cache" baseline).

Example:
    >>> import torch
    >>> from tidal.ir.plan import Plan
    >>> from tidal.ir.plans.embedding_cache import CachedTable, EmbeddingCachePlan, working_set
    >>> t = CachedTable("tables.0", num_rows=10, dim=2, bag_mode="sum",
    ...                 ids_input="tables_0_unique_ids", rows_input="tables_0_rows",
    ...                 dtype="float32")
    >>> plan = EmbeddingCachePlan(tables=(t,), lookahead=2)
    >>> Plan.from_json(plan.to_json()) == plan, t.nbytes
    (True, 80)
    >>> ws = working_set(plan, {"tables.0": torch.tensor([[4, 1], [4, 4]])},
    ...                  {"tables.0": torch.arange(20.0).reshape(10, 2)})
    >>> ws["tables_0_unique_ids"], ws["tables_0_rows"]
    (tensor([1, 4]), tensor([[2., 3.],
            [8., 9.]]))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch
import torch.fx as fx

from tidal.ir.meta import get_derived, set_derived
from tidal.ir.plan import Plan
from tidal.ir.table import format_table



@dataclass(frozen=True)
class CachedTable:
    """One cached table: ``name`` (the embedding module's path, e.g. ``"tables.3"``),
    ``num_rows`` and ``dim`` of its weight, ``bag_mode`` (``""`` for ``nn.Embedding``; ``"sum"``,
    ``"mean"``, ``"max"`` for ``nn.EmbeddingBag``), the graph's keyword inputs for its working
    set (``ids_input``: sorted distinct ids; ``rows_input``: their rows) and the weight's
    ``dtype`` (``"float32"``)."""

    name: str
    num_rows: int
    dim: int
    bag_mode: str
    ids_input: str
    rows_input: str
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        value = getattr(torch, self.dtype, None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"embedding_cache table {self.name!r}: dtype {self.dtype!r} is "
                             f"not a torch dtype")
        return value

    @property
    def nbytes(self) -> int:
        """Bytes of the whole table."""
        return self.num_rows * self.dim * self.torch_dtype.itemsize

    @property
    def kind(self) -> str:
        """``nn.Embedding`` or ``nn.EmbeddingBag(<mode>)``, for reports."""
        return f"EmbeddingBag({self.bag_mode})" if self.bag_mode else "Embedding"


@dataclass(frozen=True)
class EmbeddingCachePlan(Plan):
    """What the ``embedding_cache`` pass chose: the cached ``tables`` (in graph order) and the
    Oracle Cacher's ``lookahead`` (how many batches ahead it reads ids to cache and prefetch;
    0: only the current batch)."""

    pass_name: ClassVar[str] = "embedding_cache"

    tables: tuple[CachedTable, ...]
    lookahead: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) \
                or self.lookahead < 0:
            raise ValueError(f"EmbeddingCachePlan: lookahead={self.lookahead!r} must be an "
                             f"int >= 0")
        names = [t.name for t in self.tables]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"EmbeddingCachePlan: table {dupes[0]!r} is listed twice")

    def table_named(self, name: str) -> CachedTable:
        """The cached table ``name``; ``KeyError`` naming the cached ones otherwise."""
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"embedding_cache: {name!r} is not a cached table (cached: "
                       f"{', '.join(t.name for t in self.tables) or 'none'})")

    @property
    def nbytes(self) -> int:
        """Bytes of every cached table together."""
        return sum(t.nbytes for t in self.tables)

    def summary(self) -> str:
        return (f"{len(self.tables)} tables cached ({self.nbytes / 2**20:.3g} MiB on the "
                f"embedding servers), lookahead {self.lookahead}")

    def table(self) -> str:
        rows = [[t.name, t.kind, t.num_rows, t.dim, t.dtype, t.nbytes, t.ids_input,
                 t.rows_input] for t in self.tables]
        head = format_table(["table", "module", "rows", "dim", "dtype", "bytes", "ids input",
                             "rows input"], rows)
        return head + "\n" + self.summary()


def _op_nodes(gm: fx.GraphModule, plan: EmbeddingCachePlan) -> dict[str, fx.Node]:
    """Each cached table's ``tidal::cached_embedding`` node in ``gm``."""
    from tidal.ir.cached_embedding_op import CACHED_EMBEDDING

    found = {n.args[0]: n for n in gm.graph.nodes
             if n.op == "call_function" and n.target is CACHED_EMBEDDING}
    missing = [t.name for t in plan.tables if t.name not in found]
    if missing:
        raise ValueError(f"embedding_cache: the graph module has no cached lookup of table "
                         f"{missing[0]!r} (is it the graph the embedding_cache pass rewrote "
                         f"with this plan?)")
    return {t.name: found[t.name] for t in plan.tables}


def ids_module(gm: fx.GraphModule, plan: EmbeddingCachePlan) -> fx.GraphModule:
    """A graph module computing each cached table's ids from the model's inputs, and nothing
    else: the ancestors of every table's ``ids`` argument in the rewritten ``gm``. It takes the
    model's inputs (as ``gm`` does, without the working-set inputs) and returns a dict from
    table name to ids. ``ValueError`` if an ids argument depends on a parameter, a buffer or a
    module with parameters."""
    from tidal.ir.inputs import placeholders

    ops = _op_nodes(gm, plan)
    added = {t.ids_input for t in plan.tables} | {t.rows_input for t in plan.tables}
    wanted: set[fx.Node] = set()
    stack = [ops[t.name].args[3] for t in plan.tables]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in wanted:
            continue
        wanted.add(n)
        stack.extend(n.all_input_nodes)
    for n in wanted:
        learned = n.op == "call_module" and any(True for _ in gm.get_submodule(
            str(n.target)).parameters())
        if n.op == "get_attr" or learned or n.op == "placeholder" and n.target in added:
            raise ValueError(f"embedding_cache: the ids of a cached table depend on {n.op} "
                             f"{n.target!r}, not only on the model's inputs")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in placeholders(gm):
        if p.target not in added:
            env[p] = graph.node_copy(p, lambda x: env[x])
    for n in gm.graph.nodes:
        if n in wanted and n.op != "placeholder":
            env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output({t.name: env[ops[t.name].args[3]] for t in plan.tables})
    return fx.GraphModule(gm, graph, "TableIds")


def table_ids(gm: fx.GraphModule, plan: EmbeddingCachePlan, *inputs: Any, **kw_inputs: Any
              ) -> dict[str, torch.Tensor]:
    """Each cached table's ids for the batch ``inputs`` (the model's positional inputs, or its
    keyword inputs), computed by :func:`ids_module` without running the model. The ids module
    is kept in ``gm.meta`` for this plan and graph (rebuilt when either changes)."""
    from tidal.ir.inputs import bind_inputs

    key = (plan, gm.code)
    module = get_derived(gm, "embedding_cache.ids_module", key)
    if module is None:
        module = ids_module(gm, plan)
        set_derived(gm, "embedding_cache.ids_module", key, module)
    if kw_inputs and inputs:
        raise TypeError("table_ids: give the model's inputs positionally or by keyword, "
                        "not both")
    args = bind_inputs(module, kw_inputs, "table_ids inputs") if kw_inputs else inputs
    return dict(module(*args))


def working_set(plan: EmbeddingCachePlan, ids: Mapping[str, torch.Tensor],
                weights: Mapping[str, torch.Tensor], requires_grad: bool = False
                ) -> dict[str, torch.Tensor]:
    """The rewritten graph's keyword inputs for one batch: per cached table, its sorted
    distinct ids (``torch.unique(ids, sorted=True)``) and their rows gathered from the full
    table ``weights[name]`` (``[num_rows, dim]``; detached copies, leaves that require grad
    with ``requires_grad``). ``ValueError`` naming a table whose ids or weights are missing,
    whose weight has the wrong shape, or whose ids fall outside the table."""
    out: dict[str, torch.Tensor] = {}
    for t in plan.tables:
        for what, given in (("ids", ids), ("weights", weights)):
            if t.name not in given:
                raise ValueError(f"working_set: no {what} for cached table {t.name!r} (given: "
                                 f"{', '.join(given) or 'none'})")
        weight = weights[t.name]
        if tuple(weight.shape) != (t.num_rows, t.dim):
            raise ValueError(f"working_set: the weight of table {t.name!r} is "
                             f"{tuple(weight.shape)}, the plan says ({t.num_rows}, {t.dim})")
        unique = torch.unique(ids[t.name].to(torch.int64), sorted=True)
        if unique.numel() and (int(unique[0]) < 0 or int(unique[-1]) >= t.num_rows):
            bad = int(unique[0]) if int(unique[0]) < 0 else int(unique[-1])
            raise ValueError(f"working_set: table {t.name!r} has {t.num_rows} rows; id {bad} "
                             f"is out of range")
        unique = unique.to(weight.device)
        rows = weight.detach()[unique]
        out[t.ids_input] = unique
        out[t.rows_input] = rows.requires_grad_() if requires_grad else rows
    return out


def working_set_of(gm: fx.GraphModule, plan: EmbeddingCachePlan,
                   weights: Mapping[str, torch.Tensor], *inputs: Any,
                   requires_grad: bool = False) -> dict[str, torch.Tensor]:
    """:func:`working_set` of the batch ``inputs``: ``table_ids`` then ``working_set``."""
    return working_set(plan, table_ids(gm, plan, *inputs), weights, requires_grad)

