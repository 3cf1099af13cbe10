"""The ``embedding_cache`` pass: Bagpipe's cached embedding lookups (dissertation ch. 5).

Bagpipe keeps the embedding tables of a recommendation model on embedding servers and gives
each trainer only the rows its batch touches, prefetched by an Oracle Cacher that reads the ids
of the next ``lookahead`` batches. This pass makes the graph ready for that: every
``nn.Embedding`` / ``nn.EmbeddingBag`` call (and ``F.embedding`` / ``F.embedding_bag`` on a
weight read with ``get_attr``) whose ids derive from the model's inputs (sparse features) is
replaced by ``tidal::cached_embedding`` (:mod:`tidal.ir.cached_embedding_op`), which reads the
table's working set from two new keyword inputs, ``<table>_unique_ids`` and ``<table>_rows``
(placed after the model's inputs, default None, so the positional calling convention does not
change). The embedding module leaves the graph module (its table lives on the embedding
servers); its name, shape, dtype and mode are in the plan
(:class:`~tidal.ir.plans.embedding_cache.EmbeddingCachePlan`). Lookups whose ids come from a
buffer, a parameter, a learned value or a tensor factory (position embeddings: ``arange``) are
left as they are, each with a note saying why; so are tables whose weight the graph also reads
elsewhere (tied weights), tables renormalized in place (``max_norm``) and tables below
``min_rows``.

Options: ``lookahead`` (the Oracle Cacher's lookahead, >= 0), ``tables`` (module paths to cache;
default every eligible one; a name that is not an embedding lookup of the graph is a
``PassError``) and ``min_rows`` (smaller tables stay in the model). ``passes="auto"`` never
selects this pass: it changes what the graph takes (name it in ``passes=``).

Example:
    >>> import torch, tidal
    >>> from tidal.passes.embedding_cache import EmbeddingCache
    >>> from tidal.ir.plans.embedding_cache import table_ids, working_set
    >>> class Tiny(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb = torch.nn.EmbeddingBag(100, 4, mode="sum")
    ...         self.out = torch.nn.Linear(4, 1)
    ...     def forward(self, ids):
    ...         return self.out(self.emb(ids))
    >>> model, ids = Tiny(), torch.randint(0, 100, (8, 3))
    >>> c = tidal.compile(model, (ids,), passes=[EmbeddingCache(lookahead=2)])
    >>> plan = c.plan.get("embedding_cache")
    >>> [(t.name, t.ids_input, t.rows_input) for t in plan.tables], plan.lookahead
    ([('emb', 'emb_unique_ids', 'emb_rows')], 2)
    >>> ws = working_set(plan, table_ids(c.graph_module, plan, ids), {"emb": model.emb.weight})
    >>> torch.equal(c.graph_module(ids, **ws), model(ids))
    True
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from tidal.ir import meta
from tidal.ir.cached_embedding_op import CACHED_EMBEDDING
from tidal.ir.inputs import placeholders
from tidal.ir.pass_api import Pass, PassContext, PassResult
from tidal.ir.plans.embedding_cache import CachedTable, EmbeddingCachePlan

PASS_NAME = "embedding_cache"

_FACTORIES = frozenset({
    "arange", "range", "zeros", "ones", "full", "empty", "tensor", "as_tensor", "randint",
    "rand", "randn", "randperm", "linspace", "logspace", "eye", "zeros_like", "ones_like",
    "full_like", "empty_like", "rand_like", "randn_like", "randint_like",
    "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"})
"""Functions and methods whose values do not come from their tensor arguments' values."""


@dataclass
class Lookup:
    """One embedding lookup of the graph: the table's ``name`` (module path, or the weight's
    attribute path for ``F.embedding``), its ``node`` and ``weight``, the lookup's arguments
    (graph nodes or constants) and ``skip``, the reason it is not cached ('' if it is)."""

    name: str
    node: fx.Node
    weight: torch.Tensor
    ids: Any
    offsets: Any = None
    per_sample_weights: Any = None
    bag_mode: str = ""
    padding_idx: Optional[int] = None
    include_last_offset: bool = False
    scale_grad_by_freq: bool = False
    max_norm: Optional[float] = None
    skip: str = ""

    @property
    def kind(self) -> str:
        return f"EmbeddingBag({self.bag_mode})" if self.bag_mode else "Embedding"


def _bound(fn: Any, node: fx.Node) -> dict[str, Any]:
    """``node``'s arguments bound to ``fn``'s parameters, defaults applied."""
    args = inspect.signature(fn).bind(*node.args, **node.kwargs)
    args.apply_defaults()
    return dict(args.arguments)


def _module_lookup(node: fx.Node, module: torch.nn.Module) -> Lookup:
    """The lookup of a ``call_module`` node of an ``nn.Embedding`` / ``nn.EmbeddingBag``."""
    a = _bound(module.forward, node)
    bag = isinstance(module, torch.nn.EmbeddingBag)
    return Lookup(name=str(node.target), node=node, weight=module.weight, ids=a["input"],
                  offsets=a.get("offsets"), per_sample_weights=a.get("per_sample_weights"),
                  bag_mode=module.mode if bag else "", padding_idx=module.padding_idx,
                  include_last_offset=bool(getattr(module, "include_last_offset", False)),
                  scale_grad_by_freq=bool(module.scale_grad_by_freq), max_norm=module.max_norm)


def _function_lookup(gm: fx.GraphModule, node: fx.Node) -> Optional[Lookup]:
    """The lookup of an ``F.embedding`` / ``F.embedding_bag`` call on a parameter read with
    ``get_attr`` (None otherwise)."""
    a = _bound(node.target, node)
    w = a["weight"]
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        return None
    if not _is_parameter(gm, str(w.target)):  # a table is learned: buffers are not tables
        return None
    weight = gm.get_parameter(str(w.target))
    if weight.dim() != 2:
        return None
    pad = a.get("padding_idx")
    if isinstance(pad, int) and pad < 0:
        pad += weight.shape[0]
    bag = node.target is F.embedding_bag
    return Lookup(name=str(w.target), node=node, weight=weight, ids=a["input"],
                  offsets=a.get("offsets"), per_sample_weights=a.get("per_sample_weights"),
                  bag_mode=a["mode"] if bag else "", padding_idx=pad,
                  include_last_offset=bool(a.get("include_last_offset", False)),
                  scale_grad_by_freq=bool(a["scale_grad_by_freq"]), max_norm=a["max_norm"])


def _is_parameter(gm: fx.GraphModule, path: str) -> bool:
    try:
        gm.get_parameter(path)
        return True
    except AttributeError:
        return False


def ids_origin(gm: fx.GraphModule, ids: Any) -> str:
    """Why the values of ``ids`` do not derive from the graph's inputs alone ('' if they do):
    a ``get_attr`` (buffer or parameter), a module with weights, or a tensor factory
    (``arange``: position ids) among its ancestors, or no input at all."""
    if not isinstance(ids, fx.Node):
        return "its ids are a constant, not an input"
    seen: set[fx.Node] = set()
    stack = [ids]
    inputs = 0
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            inputs += 1
        elif n.op == "get_attr":
            what = "parameter" if _is_parameter(gm, str(n.target)) else "buffer"
            return f"its ids come from {what} {n.target!r}, not from the model's inputs"
        elif n.op == "call_module":
            m = gm.get_submodule(str(n.target))
            if any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
                return (f"its ids come from the output of module {n.target!r} (learned "
                        f"values), not from the model's inputs")
        elif n.op in ("call_function", "call_method"):
            fname = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
            if fname in _FACTORIES:
                return (f"its ids come from torch.{fname} (position-like ids), not from the "
                        f"model's inputs")
        stack.extend(n.all_input_nodes)
    return "" if inputs else "its ids do not come from the model's inputs"


def find_lookups(gm: fx.GraphModule) -> list[Lookup]:
    """Every embedding lookup of ``gm`` in graph order, with ``skip`` set (the reason) for
    those the pass cannot cache whatever the options."""
    found: list[Lookup] = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            m = gm.get_submodule(str(n.target))
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
                found.append(_module_lookup(n, m))
        elif n.op == "call_function" and n.target in (F.embedding, F.embedding_bag):
            lookup = _function_lookup(gm, n)
            if lookup is not None:
                found.append(lookup)
    for lk in found:
        lk.skip = _why_skip(gm, lk, found)
    return found


def _why_skip(gm: fx.GraphModule, lk: Lookup, found: Sequence[Lookup]) -> str:
    calls = sum(1 for other in found if other.name == lk.name)
    if calls > 1:
        return f"it is called {calls} times (one working set per table and batch)"
    readers = [n for n in gm.graph.nodes if n.op == "get_attr" and (
        n.target == lk.name or str(n.target).startswith(lk.name + "."))]
    if lk.node.op == "call_module" and readers:
        return f"the graph also reads its weight ({readers[0].target!r})"
    if lk.node.op == "call_function":
        weight_node = next(n for n in lk.node.all_input_nodes if n.target == lk.name)
        if len(weight_node.users) > 1:
            return "the graph also reads its weight elsewhere"
    ties = [name for name, p in gm.named_parameters(remove_duplicate=False)
            if p is lk.weight and name != lk.name and not name.startswith(lk.name + ".")]
    if ties:
        return f"its weight is shared with {ties[0]!r} (tied weights stay in the model)"
    if lk.max_norm is not None:
        return "max_norm renormalizes the table in place during the forward"
    return ids_origin(gm, lk.ids)


def _safe(name: str, taken: set[str]) -> str:
    base = re.sub(r"\W", "_", name)
    if not base or base[0].isdigit():
        base = f"t_{base}"
    out, k = base, 1
    while out in taken:
        out, k = f"{base}_{k}", k + 1
    taken.add(out)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class EmbeddingCache(Pass):
    """Bagpipe: embedding lookups whose ids come from the inputs read a cached working set
    (``tidal::cached_embedding``); the tables move to embedding servers, an Oracle Cacher looks
    ``lookahead`` batches ahead."""

    name = PASS_NAME

    def __init__(self, lookahead: int = 1, tables: Optional[Union[Sequence[str], str]] = None,
                 min_rows: int = 0):
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"{PASS_NAME}: lookahead={lookahead!r} must be an int >= 0 (the "
                             f"number of future batches the Oracle Cacher reads)")
        if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 0:
            raise ValueError(f"{PASS_NAME}: min_rows={min_rows!r} must be an int >= 0")
        if isinstance(tables, str):
            tables = [t.strip() for t in tables.split(",") if t.strip()]
        if tables is not None and not all(isinstance(t, str) for t in tables):
            raise ValueError(f"{PASS_NAME}: tables={tables!r} must be module paths (strings)")
        self.lookahead = lookahead
        self.tables = None if tables is None else tuple(tables)
        self.min_rows = min_rows

    def why_not(self, gm: fx.GraphModule, ctx: PassContext) -> str:
        if not any(not lk.skip for lk in find_lookups(gm)):
            return "the model has no embedding lookup whose ids come from its inputs"
        return ("it moves the embedding tables to embedding servers, so the graph then reads "
                "each batch's working set as keyword inputs; name it in passes= to use it")

    def select(self, gm: fx.GraphModule, ctx: Optional[PassContext] = None
               ) -> tuple[list[Lookup], list[str]]:
        """The lookups to cache and one note per lookup left alone. ``PassError`` for a
        ``tables`` name that is not a cacheable embedding lookup of the graph."""
        lookups = find_lookups(gm)
        by_name = {lk.name: lk for lk in lookups}
        if self.tables is not None:
            for name in self.tables:
                if name not in by_name:
                    self.fail(f"tables: {self._not_found(gm, ctx, name, by_name)}")
                if by_name[name].skip:
                    self.fail(f"tables: cannot cache {name!r}: {by_name[name].skip}")
        chosen, notes = [], []
        for lk in lookups:
            rows = lk.weight.shape[0]
            if self.tables is not None and lk.name not in self.tables:
                notes.append(f"kept {lk.name} ({lk.kind}) in the model: not in tables=")
            elif lk.skip:
                notes.append(f"kept {lk.name} ({lk.kind}) in the model: {lk.skip}")
            elif rows < self.min_rows:
                notes.append(f"kept {lk.name} ({lk.kind}) in the model: {rows} rows < "
                             f"min_rows={self.min_rows}")
            else:
                chosen.append(lk)
        return chosen, notes

    @staticmethod
    def _not_found(gm: fx.GraphModule, ctx: Optional[PassContext], name: str,
                   by_name: dict[str, Lookup]) -> str:
        model = ctx.model if ctx is not None and ctx.model is not None else gm
        modules = dict(model.named_modules())
        known = ", ".join(sorted(set(by_name))) or "none"
        if name in modules:
            m = modules[name]
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
                return f"{name!r} ({type(m).__name__}) is not called by the traced graph"
            return (f"{name!r} is a {type(m).__name__}, not an nn.Embedding or nn.EmbeddingBag "
                    f"(embedding lookups: {known})")
        return f"the model has no module {name!r} (embedding lookups: {known})"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        chosen, notes = self.select(gm, ctx)
        if not chosen:
            return PassResult(gm, notes=tuple(notes) + (
                "no table cached: the model has no embedding lookup whose ids come from its "
                "inputs",))
        graph = gm.graph
        phs = placeholders(gm)
        taken = {str(p.target) for p in phs} | {n.name for n in graph.nodes}
        tail = [p for p in phs if not str(p.target).startswith("*")]
        after = tail[-1] if tail else None
        tables, table_notes = [], []
        for lk in chosen:
            ids_name = _safe(f"{lk.name}_unique_ids", taken)
            rows_name = _safe(f"{lk.name}_rows", taken)
            new_inputs = []
            for input_name in (ids_name, rows_name):
                ctx_insert = graph.inserting_after(after) if after is not None \
                    else graph.inserting_before(next(iter(graph.nodes), None))
                with ctx_insert:
                    p = graph.placeholder(input_name, default_value=None)
                meta.set_input_name(p, input_name)
                new_inputs.append(p)
                after = p
            self._replace(gm, lk, *new_inputs)
            t = CachedTable(name=lk.name, num_rows=int(lk.weight.shape[0]),
                            dim=int(lk.weight.shape[1]), bag_mode=lk.bag_mode,
                            ids_input=ids_name, rows_input=rows_name,
                            dtype=_dtype_name(lk.weight.dtype))
            tables.append(t)
            table_notes.append(f"cached {t.name}: {t.kind}, {t.num_rows} rows x {t.dim} "
                               f"{t.dtype} ({t.nbytes / 2**20:.3g} MiB); working set from "
                               f"{t.ids_input}=, {t.rows_input}=")
        graph.lint()
        gm.recompile()
        plan = EmbeddingCachePlan(tables=tuple(tables), lookahead=self.lookahead)
        return PassResult(gm, plan=plan, notes=tuple(table_notes) + tuple(notes)
                          + (plan.summary(),))

    @staticmethod
    def _replace(gm: fx.GraphModule, lk: Lookup, ids_input: fx.Node, rows_input: fx.Node
                 ) -> None:
        """Replace ``lk``'s node with ``tidal::cached_embedding`` and drop its table from
        ``gm``."""
        graph = gm.graph
        kwargs = {}
        if lk.padding_idx is not None:
            kwargs["padding_idx"] = int(lk.padding_idx)
        if lk.include_last_offset:
            kwargs["include_last_offset"] = True
        if lk.scale_grad_by_freq:
            kwargs["scale_grad_by_freq"] = True
        with graph.inserting_before(lk.node):
            new = graph.call_function(CACHED_EMBEDDING, (
                lk.name, ids_input, rows_input, lk.ids, lk.offsets, lk.per_sample_weights,
                lk.bag_mode), kwargs)
        for get, put in ((meta.get_tensors, meta.set_tensors), (meta.get_layer, meta.set_layer)):
            value = get(lk.node)
            if value:
                put(new, value)
        lk.node.replace_all_uses_with(new)
        weight_nodes = [n for n in lk.node.all_input_nodes if n.op == "get_attr"]
        graph.erase_node(lk.node)
        if lk.node.op == "call_module":
            gm.delete_submodule(lk.name)
            return
        for n in weight_nodes:
            if n.target == lk.name and not n.users:
                graph.erase_node(n)
        owner, _, attr = lk.name.rpartition(".")
        delattr(gm.get_submodule(owner) if owner else gm, attr)

    def ensures(self, gm: fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        plan = result.plan
        if plan is None:
            return
        cached = [n.args[0] for n in gm.graph.nodes if n.target is CACHED_EMBEDDING]
        if sorted(cached) != sorted(t.name for t in plan.tables):
            self.fail(f"the graph's cached lookups {cached} are not the plan's tables")
        modules = dict(gm.named_modules())
        left = [t.name for t in plan.tables if t.name in modules]
        if left:
            self.fail(f"table {left[0]!r} is still a module of the graph module")
