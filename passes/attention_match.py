"""Find attention in a traced graph: one ``AttentionMatch`` per attention layer.

Three forms are recognised (``LOOKED_FOR`` names them for error messages):

- the eager pattern ``softmax(mask(scale(Q @ Kᵀ))) @ V`` — a softmax whose input chain (through
  scale, mask, dtype casts) starts at a matmul and whose output (through casts and dropout)
  feeds a matmul with V. This is how the zoo's Llama and BERT, and Hugging Face Llama / GPT-2
  / BERT traced with ``attn_implementation="eager"`` spell attention; also with the heads
  merged into the batch (Hugging Face OPT: ``bmm`` on ``[B*H, T, D]``, the scores viewed as
  ``[B, H, Tq, Tk]`` for the mask and back, the scaling folded into Q before the ``bmm``);
- ``torch.nn.functional.scaled_dot_product_attention`` calls;
- ``nn.MultiheadAttention`` modules (kept whole by fx as leaf modules), standalone or as the
  self-attention (``self_attn``) of torch's ``nn.TransformerEncoderLayer`` /
  ``nn.TransformerDecoderLayer``. fx keeps every ``torch.nn`` module whole, so a
  ``nn.TransformerEncoder`` (or a layer, a ``nn.TransformerDecoder``, a ``nn.Transformer``) is
  one ``call_module`` node: its attention is found among that module's submodules, and the match
  names the call node and the attention module's path inside it. A decoder layer's
  cross-attention (``multihead_attn``) is not matched (``hidden_attention`` lists it).

Graphs captured through ``torch.export`` (``tidal.ir.export_capture``) spell the same forms with
aten operators (``aten.matmul``/``bmm``/``baddbmm``, ``aten.softmax``,
``aten.scaled_dot_product_attention``, ``aten.linear``/``addmm`` projections); they are
recognised alike.

For each match the Q/K/V projection modules, the number of query heads, of KV heads (grouped-query
attention) and the head size are recorded. Shapes come from tidal's node metadata when the graph
was annotated (``tidal.compile`` does this), else from the attention module's attributes and
its projection sizes.

``eager_parts`` takes an eager match apart for a rewrite that replaces it whole: the Q, Kᵀ and
V nodes, each op between ``Q @ Kᵀ`` and ``· @ V`` as a ``Step`` (scale, mask, view, cast,
softmax, dropout; replayable exactly), the values those ops read, and the nodes a rewrite
removes; ``NotMappable`` says why a match cannot be taken apart.

Example:
    >>> import torch, tidal
    >>> from examples.models import llama_small
    >>> from tidal.passes.attention_match import find_attention
    >>> model = llama_small()
    >>> gm = tidal.trace(model, model.example_inputs(1))
    >>> [(m.scope, m.num_heads, m.num_kv_heads, m.head_dim) for m in find_attention(gm, model)]
    [('model.layers.0.self_attn', 4, 2, 16), ('model.layers.1.self_attn', 4, 2, 16)]
    >>> from tidal.passes.attention_match import eager_parts
    >>> parts = eager_parts(gm, find_attention(gm, model)[0])
    >>> [step.kind for step in parts.steps], parts.softmax.kind, parts.post
    (['scale', 'masked_fill'], 'softmax', ())
"""
from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from tidal.ir import meta

LOOKED_FOR = (
    "softmax(Q @ K^T [scale, mask]) @ V (eager attention)",
    "torch.nn.functional.scaled_dot_product_attention",
    "torch.nn.MultiheadAttention (standalone, or the self_attn of nn.TransformerEncoderLayer / "
    "nn.TransformerDecoderLayer kept whole by the tracer)",
)

_SELF_ATTENTION_LAYERS = (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)
"""torch's transformer layers whose ``self_attn`` (an ``nn.MultiheadAttention``) is matched."""

aten = torch.ops.aten
_MATMULS = {torch.matmul, operator.matmul, torch.bmm, torch.baddbmm, aten.matmul, aten.bmm,
            aten.baddbmm}
_MATMUL_METHODS = {"matmul", "bmm", "__matmul__"}
_SOFTMAX_FUNCS = {torch.softmax, F.softmax, torch.Tensor.softmax, aten.softmax}
# Ops allowed between the scores matmul and the softmax, or between the softmax and ·V.
_PASS_THROUGH_FUNCS = {operator.mul, operator.truediv, operator.add, operator.sub, torch.mul,
                       torch.div, torch.add, torch.where, torch.masked_fill, F.dropout,
                       torch.dropout, torch.max, torch.maximum, torch.reshape, torch.tanh,
                       aten.mul, aten.div, aten.add, aten.sub, aten.where, aten.masked_fill,
                       aten.mul_, aten.div_, aten.add_, aten.sub_, aten.masked_fill_,
                       aten.dropout, aten.max, aten.maximum, aten.reshape, aten.view, aten.tanh,
                       aten.to, aten._to_copy, aten.type_as, aten.contiguous}
# aten ops (graphs captured through torch.export) by their overload packet (``_fn``);
# view/reshape: attention on heads merged into the batch (OPT's [B*H, T, D] bmm) views its
# scores as [B, H, Tq, Tk] to add the mask and back before the softmax; tanh: soft-capped
# scores (Gemma 2)
_PASS_THROUGH_METHODS = {"to", "type", "float", "half", "masked_fill", "masked_fill_", "mul",
                         "div", "add", "contiguous", "type_as", "view", "reshape", "tanh"}
_SCORE_DEPTH = 8      # ops searched between Q·Kᵀ and the softmax
_PROJ_DEPTH = 60      # ops searched from Q/K/V back to their projection


@dataclass(frozen=True)
class AttentionMatch:
    """One attention layer found in a graph.

    ``kind`` is ``"eager"``, ``"sdpa"`` or ``"module"`` (``nn.MultiheadAttention``); ``node``
    the node to rewrite (the softmax, the SDPA call or the module call: the
    ``nn.MultiheadAttention`` itself, or the torch transformer layer or stack that holds it);
    ``scores`` the Q·Kᵀ matmul node (eager only); ``scope`` the attention module's path (for
    ``"module"``, the ``nn.MultiheadAttention``'s, which is below the call node's target when a
    transformer layer holds it); ``q_proj``/``k_proj``/
    ``v_proj`` the projection modules' paths (equal for fused projections like GPT-2's
    ``c_attn``); ``num_heads`` query heads, ``num_kv_heads`` KV heads, ``head_dim`` head size.
    """

    index: int
    kind: str
    node: str
    scores: Optional[str]
    scope: str
    q_proj: str
    k_proj: str
    v_proj: str
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for multi-head attention)."""
        return self.num_heads // self.num_kv_heads


class NoAttentionFound(ValueError):
    """The graph has no attention the matcher recognises (the message lists what it looked for)."""


def no_attention_message(gm: fx.GraphModule) -> str:
    """The message for a graph without recognised attention: what was looked for."""
    return (f"no attention found in {type(gm).__name__} "
            f"({len(gm.graph.nodes)} nodes); looked for: " + "; ".join(LOOKED_FOR))


def _fn(n: fx.Node) -> Any:
    """A ``call_function`` node's function; for an aten operator overload
    (``aten.matmul.default``) its overload packet (``aten.matmul``), so that the sets above name
    every overload."""
    return getattr(n.target, "overloadpacket", n.target)


def _is_softmax(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_function":
        return _fn(n) in _SOFTMAX_FUNCS
    if n.op == "call_method":
        return n.target == "softmax"
    if n.op == "call_module":
        return isinstance(gm.get_submodule(n.target), torch.nn.Softmax)
    return False


def _is_matmul(n: fx.Node) -> bool:
    return (n.op == "call_function" and _fn(n) in _MATMULS) or \
        (n.op == "call_method" and n.target in _MATMUL_METHODS)


def _passes_through(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_function":
        return _fn(n) in _PASS_THROUGH_FUNCS
    if n.op == "call_method":
        return n.target in _PASS_THROUGH_METHODS
    if n.op == "call_module":
        return isinstance(gm.get_submodule(n.target), torch.nn.Dropout)
    return False


def _node_args(n: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), lambda a: out.append(a))
    return out


def _scores_of(gm: fx.GraphModule, softmax: fx.Node) -> Optional[fx.Node]:
    """The Q·Kᵀ matmul feeding ``softmax`` through scale/mask/cast ops, or None."""
    frontier = deque([(a, 1) for a in _node_args(softmax)])
    seen: set[fx.Node] = set()
    while frontier:
        n, depth = frontier.popleft()
        if n in seen or depth > _SCORE_DEPTH:
            continue
        seen.add(n)
        if _is_matmul(n):
            return n
        if _passes_through(gm, n):
            frontier.extend((a, depth + 1) for a in _node_args(n))
    return None


def _value_matmul_of(gm: fx.GraphModule, softmax: fx.Node) -> Optional[fx.Node]:
    """The probs·V matmul that consumes ``softmax`` (through casts and dropout), or None."""
    current = softmax
    for _ in range(_SCORE_DEPTH):
        users = list(current.users)
        for u in users:
            if _is_matmul(u) and u.args and u.args[0] is current:
                return u
        nxt = [u for u in users if _passes_through(gm, u)]
        if len(nxt) != 1:
            return None
        current = nxt[0]
    return None


def _projection_of(gm: fx.GraphModule, start: Any) -> str:
    """Path of the nearest projection (a Linear-like module or a weight matmul) above ``start``."""
    if not isinstance(start, fx.Node):
        return ""
    frontier, seen = deque([(start, 0)]), set()
    while frontier:
        n, depth = frontier.popleft()
        if n in seen or depth > _PROJ_DEPTH:
            continue
        seen.add(n)
        if n.op == "call_module":
            mod = gm.get_submodule(n.target)
            weight = getattr(mod, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                return n.target
        if n.op == "call_function" and _fn(n) in (F.linear, torch.addmm, torch.matmul,
                                                  operator.matmul, aten.linear, aten.addmm,
                                                  aten.matmul, aten.mm):
            weights = [a for a in _node_args(n) if a.op == "get_attr"]
            if weights:
                return weights[-1].target.rpartition(".")[0]
        frontier.extend((a, depth + 1) for a in _node_args(n))
    return ""


def _module_int(mod: Optional[torch.nn.Module], names: tuple[str, ...]) -> Optional[int]:
    """The first integer attribute among ``names`` on ``mod`` or its ``config``."""
    for holder in (mod, getattr(mod, "config", None)):
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _out_features(gm: fx.GraphModule, path: str) -> Optional[int]:
    try:
        weight = getattr(gm.get_submodule(path), "weight", None)
    except AttributeError:
        return None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    # nn.Linear stores [out, in]; HF's Conv1D stores [in, out] and says so with ``nf``.
    nf = getattr(gm.get_submodule(path), "nf", None)
    return nf if isinstance(nf, int) else weight.shape[0]


def _shape(n: Optional[fx.Node]) -> Optional[tuple[int, ...]]:
    if n is None:
        return None
    tensors = meta.get_tensors(n)
    return tuple(tensors[0].shape) if tensors else None


def _scope_module(gm: fx.GraphModule, model: Optional[torch.nn.Module],
                  scope: str) -> Optional[torch.nn.Module]:
    """The attention module at ``scope``: from the original model when given (a GraphModule
    keeps only the submodules it calls, without their attributes), else from ``gm``."""
    for root in (model, gm):
        if root is None or not scope:
            continue
        try:
            return root.get_submodule(scope)
        except AttributeError:
            continue
    return None


def _head_counts(gm: fx.GraphModule, mod: Optional[torch.nn.Module], scope: str,
                 scores: Optional[fx.Node], q: Any, k: Any, q_proj: str,
                 k_proj: str) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_dim)`` from shapes, module attributes and projections."""
    heads = _module_int(mod, ("num_heads", "num_attention_heads", "n_head"))
    head_dim = _module_int(mod, ("head_dim", "attention_head_size", "head_size"))
    s_shape, q_shape = _shape(scores), _shape(q if isinstance(q, fx.Node) else None)
    if s_shape is not None and len(s_shape) == 4:
        heads = s_shape[1]
    if q_shape is not None and len(q_shape) == 4:
        heads, head_dim = q_shape[1], q_shape[-1]
    q_out = _out_features(gm, q_proj)
    if heads is None and head_dim and q_out:
        heads = q_out // head_dim
    if head_dim is None and heads and q_out:
        head_dim = q_out // heads
    kv = _module_int(mod, ("num_key_value_heads",))
    k_shape = _shape(k if isinstance(k, fx.Node) else None)
    if kv is None and scores is None and k_shape is not None and len(k_shape) == 4:
        kv = k_shape[1]     # SDPA sees K before any repeat (enable_gqa)
    k_out = _out_features(gm, k_proj)
    if kv is None and k_proj != q_proj and k_out and head_dim:
        kv = k_out // head_dim
    if heads is None or head_dim is None:
        raise NoAttentionFound(f"attention at {scope or '<top>'}: cannot tell its head count "
                               f"(no shapes recorded and no num_heads/head_dim attributes)")
    return heads, kv or heads, head_dim


def _eager_match(gm: fx.GraphModule, model: Optional[torch.nn.Module], softmax: fx.Node,
                 index: int) -> Optional[AttentionMatch]:
    scores = _scores_of(gm, softmax)
    pv = _value_matmul_of(gm, softmax)
    if scores is None or pv is None or len(scores.args) < 2:
        return None
    # baddbmm(input, Q, Kᵀ) adds Q·Kᵀ to ``input`` (GPT-NeoX: zeros, scaled by ``alpha``)
    first = 1 if _fn(scores) in (torch.baddbmm, aten.baddbmm) and len(scores.args) > 2 else 0
    q, k, v = scores.args[first], scores.args[first + 1], pv.args[1]
    scope = meta.module_scope(softmax)
    q_proj, k_proj, v_proj = (_projection_of(gm, x) for x in (q, k, v))
    heads, kv, dim = _head_counts(gm, _scope_module(gm, model, scope), scope, scores, q, k,
                                  q_proj, k_proj)
    return AttentionMatch(index, "eager", softmax.name, scores.name, scope, q_proj, k_proj,
                          v_proj, heads, kv, dim)


def _sdpa_match(gm: fx.GraphModule, model: Optional[torch.nn.Module], n: fx.Node,
                index: int) -> AttentionMatch:
    q, k, v = (n.args + (None, None, None))[:3]
    scope = meta.module_scope(n)
    q_proj, k_proj, v_proj = (_projection_of(gm, x) for x in (q, k, v))
    heads, kv, dim = _head_counts(gm, _scope_module(gm, model, scope), scope, None, q, k,
                                  q_proj, k_proj)
    return AttentionMatch(index, "sdpa", n.name, None, scope, q_proj, k_proj, v_proj,
                          heads, kv, dim)


def _child_path(parent: str, name: str) -> str:
    """``parent.name``; either may be empty (the root, or the module itself)."""
    return ".".join(p for p in (parent, name) if p)


def self_attention_paths(mod: torch.nn.Module, path: str = "") -> list[str]:
    """Paths (under ``path``, ``mod``'s own) of the ``nn.MultiheadAttention`` modules a call of
    ``mod`` runs as self-attention: ``mod`` itself, or the ``self_attn`` of every torch
    transformer layer in it (``nn.TransformerEncoderLayer``/``DecoderLayer``, also inside a
    ``nn.TransformerEncoder``/``Decoder``/``Transformer``), in module order."""
    if isinstance(mod, torch.nn.MultiheadAttention):
        return [path]
    return [_child_path(_child_path(path, name), "self_attn")
            for name, sub in mod.named_modules()
            if isinstance(sub, _SELF_ATTENTION_LAYERS)
            and isinstance(sub.self_attn, torch.nn.MultiheadAttention)]


def _module_match(gm: fx.GraphModule, n: fx.Node, path: str, index: int) -> AttentionMatch:
    mod = gm.get_submodule(path)
    return AttentionMatch(index, "module", n.name, None, path, path, path, path,
                          mod.num_heads, mod.num_heads, mod.head_dim)


def _matches_at(gm: fx.GraphModule, model: Optional[torch.nn.Module], n: fx.Node,
                index: int) -> list[AttentionMatch]:
    """The attention layers node ``n`` runs (several for a torch transformer stack)."""
    paths = self_attention_paths(gm.get_submodule(n.target), n.target) \
        if n.op == "call_module" else []
    if paths:
        return [_module_match(gm, n, p, index + i) for i, p in enumerate(paths)]
    match = None
    if n.op == "call_function" and _fn(n) in (F.scaled_dot_product_attention,
                                               aten.scaled_dot_product_attention):
        match = _sdpa_match(gm, model, n, index)
    elif _is_softmax(gm, n):
        match = _eager_match(gm, model, n, index)
    return [match] if match is not None else []


def find_attention(gm: fx.GraphModule,
                   model: Optional[torch.nn.Module] = None) -> list[AttentionMatch]:
    """Every attention layer of ``gm`` in graph order (empty when there is none).

    ``model`` is the module ``gm`` was traced from; its attention modules' attributes
    (``num_heads``, ``head_dim``, ``config``...) fill in what shapes do not say."""
    found: list[AttentionMatch] = []
    for n in gm.graph.nodes:
        found.extend(_matches_at(gm, model, n, len(found)))
    return found


def hidden_attention(gm: fx.GraphModule, matches: list[AttentionMatch]) -> list[str]:
    """Paths of the ``nn.MultiheadAttention`` modules inside modules ``gm`` calls whole that no
    match covers (e.g. a ``nn.TransformerDecoderLayer``'s cross-attention ``multihead_attn``, or
    attention in a module kept whole with ``leaf_modules``)."""
    matched = {m.scope for m in matches}
    targets = dict.fromkeys(n.target for n in gm.graph.nodes if n.op == "call_module")
    return [_child_path(t, name) for t in targets
            for name, sub in gm.get_submodule(t).named_modules()
            if isinstance(sub, torch.nn.MultiheadAttention)
            and _child_path(t, name) not in matched]


def require_attention(gm: fx.GraphModule,
                      model: Optional[torch.nn.Module] = None) -> list[AttentionMatch]:
    """Like :func:`find_attention`, but raise ``NoAttentionFound`` (listing what was looked for)
    when nothing matches."""
    found = find_attention(gm, model)
    if not found:
        raise NoAttentionFound(no_attention_message(gm))
    return found


# --- an eager match taken apart: Q, K, V and the ops between them --------------------------

@dataclass(frozen=True)
class Operand:
    """A graph value an eager attention's ops read besides the scores: ``EagerParts.operands
    [index]``. ``SCORES`` marks the scores themselves in a step's arguments and ``TRAINING``
    the training flag of the module that replays the step (an ``nn.Dropout``'s own)."""

    index: int


SCORES = Operand(-1)
TRAINING = Operand(-2)


@dataclass(frozen=True)
class Earlier:
    """The scores as an earlier op of the chain left them (``index`` 0: ``Q @ Kᵀ``; i: after
    the i-th op), read by a later op besides its scores (T5: ``probs.type_as(scores)``)."""

    index: int


def _fill(template: Any, x: Any, operands: tuple, training: bool,
          earlier: Optional[list] = None) -> Any:
    """``template`` with ``SCORES``, ``TRAINING``, every ``Operand`` and ``Earlier`` replaced
    by its value (``earlier`` None: an ``Earlier`` is ``x``)."""
    if isinstance(template, Operand):
        return x if template == SCORES else training if template == TRAINING \
            else operands[template.index]
    if isinstance(template, Earlier):
        return x if earlier is None else earlier[template.index]
    if isinstance(template, (tuple, list)):
        return type(template)(_fill(t, x, operands, training, earlier) for t in template)
    if isinstance(template, slice):
        return slice(*(_fill(t, x, operands, training, earlier)
                       for t in (template.start, template.stop, template.step)))
    return template


@dataclass(frozen=True)
class Step:
    """One op of an eager attention between ``Q @ Kᵀ`` and ``· @ V``, kept so that it can be
    replayed exactly (``replay``) and read as what it does to the scores (``kind`` and
    ``params``, templates like ``args``):

    - ``scale`` (``params``: the factor) and ``divide`` (the divisor);
    - ``add`` and ``subtract`` (the tensor or number added or subtracted: a mask);
    - ``where`` (the condition, the fill value, whether the scores are kept where the
      condition is True), ``masked_fill`` (the mask, True where filled, and the fill value)
      and ``clamp_min`` (the bound): a boolean mask written as a fill value;
    - ``view`` (the shape: heads merged into the batch or split out of it), ``cast`` and
      ``same`` (``contiguous``);
    - ``softmax`` (the dim and dtype) and ``dropout`` (the probability and the training flag).
    """

    kind: str
    target: Any
    method: bool
    args: tuple
    kwargs: tuple
    params: tuple = ()

    def replay(self, x: torch.Tensor, operands: tuple, training: bool,
               earlier: Optional[list] = None) -> torch.Tensor:
        """The original op on scores ``x`` (``operands``: the values of ``EagerParts.operands``;
        ``training``: the replaying module's flag, for a dropout module's step; ``earlier``:
        the chain's values so far, for an ``Earlier``)."""
        args = _fill(self.args, x, operands, training, earlier)
        kwargs = {k: _fill(v, x, operands, training, earlier) for k, v in self.kwargs}
        if self.method:
            return getattr(args[0], self.target)(*args[1:], **kwargs)
        return self.target(*args, **kwargs)

    def values(self, operands: tuple, training: bool) -> tuple:
        """``params`` with their values."""
        return _fill(self.params, None, operands, training)


@dataclass(frozen=True)
class EagerParts:
    """An eager match taken apart, for a rewrite that replaces the nodes from ``scores``
    (``query @ key_t``) to ``output`` (``probs @ value``) by one call ``f(query, key_t, value,
    *operands)``: ``steps`` lead from the scores to the softmax's input, ``softmax`` is the
    softmax, ``post`` leads from its output to the ``· @ value`` matmul (casts, dropout).
    ``removed`` are the nodes such a rewrite erases (in graph order: the chain, and nodes that
    only read its shapes and are unused); ``redirect`` the ``getattr(node, "dtype"/"device")``
    nodes of the chain that other values still read, all of which equal the query's (and an
    exported graph's ``aten.sym_size.int(node, 0)`` where the node has the query's rows)."""

    scores: str
    output: str
    query: str
    key_t: str
    value: str
    operands: tuple[str, ...]
    steps: tuple[Step, ...]
    softmax: Step
    post: tuple[Step, ...]
    removed: tuple[str, ...]
    redirect: tuple[str, ...]


class NotMappable(ValueError):
    """An eager match whose ops between ``Q @ Kᵀ`` and ``· @ V`` are not all understood."""


_METADATA_ATTRS = {"dtype", "device", "shape", "ndim", "is_cuda", "layout"}
_METADATA_METHODS = {"size", "dim", "numel", "get_device"}


_SIZE_OPS = {aten.sym_size, aten.sym_numel, aten.sym_stride}
"""What an exported graph reads a symbolic size with (``aten.sym_size.int(x, 0)``)."""


def _reads_metadata(n: fx.Node, of: fx.Node) -> bool:
    """Whether ``n`` reads only ``of``'s metadata (dtype, device, shape), not its values."""
    if n.op == "call_function" and n.target is getattr:
        return n.args[0] is of and n.args[1] in _METADATA_ATTRS
    if n.op == "call_function" and _fn(n) in _SIZE_OPS:
        return n.args[0] is of
    return n.op == "call_method" and n.target in _METADATA_METHODS and n.args[0] is of


def _data_users(n: fx.Node) -> list[fx.Node]:
    return [u for u in n.users if not _reads_metadata(u, n)]


def _tainted(scores: fx.Node) -> set[fx.Node]:
    """The nodes whose values depend on ``scores`` (through data, not through metadata)."""
    seen, todo = {scores}, [scores]
    while todo:
        for u in _data_users(todo.pop()):
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def _dead(n: fx.Node, memo: dict) -> bool:
    """Whether ``n`` and everything that reads it is pure and unused (e.g. a shape check)."""
    if n not in memo:
        memo[n] = False
        memo[n] = n.op in ("call_function", "call_method") and not n.is_impure() and \
            not (n.op == "call_method" and n.target.endswith("_")) and \
            all(_dead(u, memo) for u in n.users)
    return memo[n]


_MUL = ({operator.mul, torch.mul, aten.mul, aten.mul_}, {"mul", "__mul__"})
_DIV = ({operator.truediv, torch.div, torch.true_divide, aten.div, aten.div_},
        {"div", "true_divide", "__truediv__"})
_ADD = ({operator.add, torch.add, aten.add, aten.add_}, {"add", "__add__"})
_SUB = ({operator.sub, torch.sub, aten.sub, aten.sub_}, {"sub", "__sub__"})
_WHERE = ({torch.where, aten.where}, set())
_MASKED_FILL = ({torch.masked_fill, aten.masked_fill, aten.masked_fill_},
                {"masked_fill", "masked_fill_"})
_MAXIMUM = ({torch.max, torch.maximum, aten.max, aten.maximum}, {"max", "maximum"})
_CLAMP = ({torch.clamp, torch.clamp_min, aten.clamp, aten.clamp_min}, {"clamp", "clamp_min"})
_VIEW = ({torch.reshape, aten.reshape, aten.view}, {"view", "reshape"})
_CAST = ({aten.to, aten._to_copy, aten.type_as},
         {"to", "type", "float", "half", "double", "bfloat16", "type_as"})
_SAME = ({aten.contiguous, aten.alias}, {"contiguous"})
_DROPOUT = ({F.dropout, torch.dropout, aten.dropout}, set())


def _op_name(n: fx.Node) -> str:
    """``name (op)`` of a node, for messages."""
    return f"{n.name} ({n.target if isinstance(n.target, str) else n.target.__name__})"


def _is(n: fx.Node, ops: tuple[set, set]) -> bool:
    return (n.op == "call_function" and _fn(n) in ops[0]) or \
        (n.op == "call_method" and n.target in ops[1])


class _Templates:
    """Turns a node's arguments into step templates: the scores become ``SCORES``, every other
    node an ``Operand`` (one per distinct node, in first-use order)."""

    def __init__(self, tainted: set[fx.Node]) -> None:
        self.tainted = tainted
        self.nodes: list[fx.Node] = []
        self.chain: list[fx.Node] = []   # nodes a later op may read as ``Earlier``

    def __call__(self, value: Any, x: fx.Node) -> Any:
        if isinstance(value, fx.Node):
            if value is x:
                return SCORES
            if value in self.chain:
                return Earlier(self.chain.index(value))
            if value in self.tainted:
                raise NotMappable(f"{value.name} reads the scores besides {x.name}")
            if value not in self.nodes:
                self.nodes.append(value)
            return Operand(self.nodes.index(value))
        if isinstance(value, (tuple, list)):
            return type(value)(self(v, x) for v in value)
        if isinstance(value, slice):
            return slice(self(value.start, x), self(value.stop, x), self(value.step, x))
        if isinstance(value, dict):
            raise NotMappable("a dict argument")
        return value


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _params(n: fx.Node, args: tuple, kwargs: dict) -> tuple[str, tuple]:
    """``(kind, params)`` of a chain op ``n`` with templated ``args``/``kwargs`` (the scores
    already ``SCORES``); ``NotMappable`` for an op that is not understood."""
    def other() -> Any:
        if len(args) != 2 or kwargs:
            raise NotMappable(f"{n.name}: unexpected arguments")
        return args[1] if args[0] == SCORES else args[0]

    first = bool(args) and args[0] == SCORES
    if _is(n, _MUL):
        return "scale", (other(),)
    if _is(n, _ADD):
        return "add", (other(),)
    if _is(n, _DIV) and first:
        return "divide", (other(),)
    if _is(n, _SUB) and first:
        return "subtract", (other(),)
    if _is(n, _WHERE) and len(args) == 3 and not kwargs and SCORES in args[1:]:
        keep = args[1] == SCORES
        return "where", (args[0], args[2] if keep else args[1], keep)
    if _is(n, _MASKED_FILL) and first:
        return "masked_fill", (_arg(args, kwargs, 1, "mask"), _arg(args, kwargs, 2, "value"))
    if _is(n, _MAXIMUM):
        return "clamp_min", (other(),)
    if _is(n, _CLAMP) and first and _arg(args, kwargs, 2, "max") is None and \
            set(kwargs) <= {"min", "max"}:
        return "clamp_min", (_arg(args, kwargs, 1, "min"),)
    if _is(n, _VIEW) and first:
        shape = args[1:] if len(args) > 1 else (kwargs.get("shape", kwargs.get("size")),)
        return "view", tuple(shape)
    if _is(n, _CAST) and first:
        return "cast", ()
    if _is(n, _SAME) and first:
        return "same", ()
    raise NotMappable(f"{_op_name(n)} between the scores and V")


def _softmax_step(gm: fx.GraphModule, n: fx.Node, t: _Templates, x: fx.Node) -> Step:
    if n.op == "call_module":
        dim = gm.get_submodule(n.target).dim
        return Step("softmax", F.softmax, False, (SCORES,), (("dim", dim),), (dim, None))
    args, kwargs = t(n.args, x), {k: t(v, x) for k, v in n.kwargs.items()}
    if not args or args[0] != SCORES:
        raise NotMappable(f"{n.name}: the softmax does not read the scores first")
    dtype_at = 3 if n.target is F.softmax else 2     # F.softmax(input, dim, _stacklevel, dtype)
    return Step("softmax", n.target, n.op == "call_method", args, tuple(kwargs.items()),
                (_arg(args, kwargs, 1, "dim"), _arg(args, kwargs, dtype_at, "dtype")))


def _step(gm: fx.GraphModule, n: fx.Node, t: _Templates, x: fx.Node, post: bool) -> Step:
    """The ``Step`` of chain node ``n`` whose scores argument is ``x`` (``post``: between the
    softmax and V, where only casts and dropout are understood)."""
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if post and isinstance(mod, torch.nn.Dropout) and len(n.args) == 1 and not n.kwargs:
            return Step("dropout", F.dropout, False, (SCORES,),
                        (("p", mod.p), ("training", TRAINING)), (mod.p, TRAINING))
        raise NotMappable(f"{n.name} ({type(mod).__name__}) between the scores and V")
    args, kwargs = t(n.args, x), {k: t(v, x) for k, v in n.kwargs.items()}
    first = bool(args) and args[0] == SCORES
    if post and first and _is(n, _DROPOUT):
        training = "training" if n.target is F.dropout else "train"
        params = (_arg(args, kwargs, 1, "p", 0.5), _arg(args, kwargs, 2, training, True))
        return Step("dropout", n.target, False, args, tuple(kwargs.items()), params)
    if post and not (_is(n, _CAST) or _is(n, _SAME)):
        raise NotMappable(f"{_op_name(n)} between the softmax and V")
    kind, params = _params(n, args, kwargs)
    return Step(kind, n.target, n.op == "call_method", args, tuple(kwargs.items()), params)


def _scalar_like(n: Any) -> bool:
    """Whether ``n`` is a number or a graph value known to be one element (0-d)."""
    if not isinstance(n, fx.Node):
        return isinstance(n, (int, float, bool))
    shape = _shape(n)
    if shape is not None:
        return shape == ()
    return n.op == "call_function" and (
        _fn(n) in (torch.full, aten.full) and tuple(n.args[0]) == () or
        n.target is torch.tensor and not isinstance(n.args[0], (tuple, list)))


def _keeps_dtype(step: Step, operands: list[fx.Node]) -> bool:
    """Whether ``step`` leaves the scores' dtype as it is: a view, or an op whose value (factor,
    mask, fill) is a number or 0-d (a mask tensor may promote the scores' dtype)."""
    if step.kind in ("view", "same"):
        return True
    if step.kind not in ("scale", "divide", "add", "subtract", "where", "masked_fill",
                         "clamp_min"):
        return False
    value = step.params[1] if step.kind in ("where", "masked_fill") else step.params[0]
    return _scalar_like(operands[value.index] if isinstance(value, Operand) else value)


def _same_dtype_as_query(chain: list[fx.Node], steps: list[Step], operands: list[fx.Node],
                         query: fx.Node, n: fx.Node) -> bool:
    """Whether chain node ``n`` has the query's dtype: recorded so (``tidal.compile`` records
    dtypes), or, with no record, the scores' dtype kept by every op up to ``n``."""
    recorded = [meta.get_tensors(x) for x in (n, query)]
    if all(recorded):
        return recorded[0][0].dtype == recorded[1][0].dtype
    for node, step in zip(chain, [None] + steps):
        if step is not None and not _keeps_dtype(step, operands):
            return False
        if node is n:
            return True
    return False


def _same_rows(n: fx.Node, query: fx.Node) -> bool:
    """Whether chain node ``n`` is recorded with as many rows (dimension 0) as the query."""
    shapes = [meta.get_tensors(x) for x in (n, query)]
    return all(shapes) and shapes[0][0].shape[:1] == shapes[1][0].shape[:1]


def eager_parts(gm: fx.GraphModule, match: AttentionMatch) -> EagerParts:
    """The parts of an eager match (``match.kind == "eager"``) that a rewrite computing only
    some heads' scores needs: Q, Kᵀ, V, the ops between (scale, mask, views, casts, dropout)
    and the nodes such a rewrite removes. ``NotMappable`` (with the reason) when an op between
    is not understood, a node besides the chain reads the scores or the probabilities, or a
    node reads a chain node's dtype that may differ from the query's."""
    nodes = {n.name: n for n in gm.graph.nodes}
    scores, softmax = nodes[match.scores], nodes[match.node]
    if not _is_matmul(scores) or len(scores.args) != 2 or scores.kwargs or \
            not all(isinstance(a, fx.Node) for a in scores.args):
        raise NotMappable(f"{scores.name}: the scores are not a matmul of two graph values")
    query, key_t = scores.args
    tainted = _tainted(scores)
    t = _Templates(tainted)
    chain, steps = [], []      # from the softmax's input back to the scores
    n = softmax.args[0] if softmax.args else None
    while n is not scores:
        if not isinstance(n, fx.Node) or n not in tainted:
            raise NotMappable(f"no single path of ops from {scores.name} to {softmax.name}")
        xs = [a for a in _node_args(n) if a in tainted]
        if len(xs) != 1:
            raise NotMappable(f"{n.name} reads the scores more than once")
        steps.append(_step(gm, n, t, xs[0], post=False))
        chain.append(n)
        n = xs[0]
    chain, steps = [scores] + chain[::-1], steps[::-1]
    soft = _softmax_step(gm, softmax, t, chain[-1])
    chain.append(softmax)
    t.chain = chain
    post, memo = [], {}
    while True:
        users = [u for u in _data_users(chain[-1]) if not _dead(u, memo)]
        if len(users) != 1:
            raise NotMappable(f"{chain[-1].name}: the probabilities are read besides · V")
        (u,) = users
        if _is_matmul(u) and len(u.args) == 2 and not u.kwargs and u.args[0] is chain[-1]:
            break
        post.append(_step(gm, u, t, chain[-1], post=True))
        chain.append(u)
    output, value = u, u.args[1]
    if not isinstance(value, fx.Node) or value in tainted:
        raise NotMappable(f"{output.name}: V is not a graph value independent of the scores")
    operands = list(t.nodes)
    removed, redirect = set(chain) | {output}, []
    for c in chain:
        for r in list(c.users):
            if r in removed:
                continue
            if _dead(r, memo):     # e.g. a shape check whose result is unused
                stack = [r]
                while stack:
                    d = stack.pop()
                    removed.add(d)
                    stack.extend(d.users)
            elif _reads_metadata(r, c) and (r.target is getattr and (
                    r.args[1] == "device" or r.args[1] == "dtype" and
                    _same_dtype_as_query(chain, steps, operands, query, c)) or
                    r.target is aten.sym_size.int and r.args[1] == 0 and
                    _same_rows(c, query)):
                redirect.append(r.name)
            else:
                raise NotMappable(f"{_op_name(r)} reads {c.name} as well")
    order = {x: i for i, x in enumerate(gm.graph.nodes)}
    return EagerParts(scores.name, output.name, query.name, key_t.name, value.name,
                      tuple(o.name for o in operands), tuple(steps), soft, tuple(post),
                      tuple(x.name for x in sorted(removed, key=order.__getitem__)),
                      tuple(redirect))
