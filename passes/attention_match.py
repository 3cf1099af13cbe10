"""Find attention in a traced graph: one ``AttentionMatch`` per attention layer.

Three forms are recognised (``LOOKED_FOR`` names them for error messages):

- the eager pattern ``softmax(mask(scale(Q @ Kᵀ))) @ V`` — a softmax whose input chain (through
  scale, mask, dtype casts) starts at a matmul and whose output (through casts and dropout)
  feeds a matmul with V. This is how the zoo's Llama and BERT, and Hugging Face Llama / GPT-2
  traced with ``attn_implementation="eager"`` spell attention;
- ``torch.nn.functional.scaled_dot_product_attention`` calls;
- ``nn.MultiheadAttention`` modules (kept whole by fx as leaf modules), standalone or as the
  self-attention (``self_attn``) of torch's ``nn.TransformerEncoderLayer`` /
  ``nn.TransformerDecoderLayer``. fx keeps every ``torch.nn`` module whole, so a
  ``nn.TransformerEncoder`` (or a layer, a ``nn.TransformerDecoder``, a ``nn.Transformer``) is
  one ``call_module`` node: its attention is found among that module's submodules, and the match
  names the call node and the attention module's path inside it. A decoder layer's
  cross-attention (``multihead_attn``) is not matched (``hidden_attention`` lists it).

For each match the Q/K/V projection modules, the number of query heads, of KV heads (grouped-query
attention) and the head size are recorded. Shapes come from tidal's node metadata when the graph
was annotated (``tidal.compile`` does this), else from the attention module's attributes and
its projection sizes.

Example:
    >>> import torch, tidal
    >>> from examples.models import llama_small
    >>> from tidal.passes.attention_match import find_attention
    >>> model = llama_small()
    >>> gm = tidal.trace(model, model.example_inputs(1))
    >>> [(m.scope, m.num_heads, m.num_kv_heads, m.head_dim) for m in find_attention(gm, model)]
    [('model.layers.0.self_attn', 4, 2, 16), ('model.layers.1.self_attn', 4, 2, 16)]
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

_MATMULS = {torch.matmul, operator.matmul, torch.bmm, torch.baddbmm}
_MATMUL_METHODS = {"matmul", "bmm", "__matmul__"}
_SOFTMAX_FUNCS = {torch.softmax, F.softmax, torch.Tensor.softmax}
# Ops allowed between the scores matmul and the softmax, or between the softmax and ·V.
_PASS_THROUGH_FUNCS = {operator.mul, operator.truediv, operator.add, operator.sub, torch.mul,
                       torch.div, torch.add, torch.where, torch.masked_fill, F.dropout,
                       torch.dropout}
_PASS_THROUGH_METHODS = {"to", "type", "float", "half", "masked_fill", "masked_fill_", "mul",
                         "div", "add", "contiguous", "type_as"}
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


def _is_softmax(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_function":
        return n.target in _SOFTMAX_FUNCS
    if n.op == "call_method":
        return n.target == "softmax"
    if n.op == "call_module":
        return isinstance(gm.get_submodule(n.target), torch.nn.Softmax)
    return False


def _is_matmul(n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target in _MATMULS) or \
        (n.op == "call_method" and n.target in _MATMUL_METHODS)


def _passes_through(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_function":
        return n.target in _PASS_THROUGH_FUNCS
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
        if n.op == "call_function" and n.target in (F.linear, torch.addmm, torch.matmul,
                                                     operator.matmul):
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
    head_dim = _module_int(mod, ("head_dim", "attention_head_size"))
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
    q, k, v = scores.args[0], scores.args[1], pv.args[1]
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
    if n.op == "call_function" and n.target is F.scaled_dot_product_attention:
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
