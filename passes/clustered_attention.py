"""Pass ``clustered_attention``: CHAI, clustered head attention (dissertation ch. 6).

Every attention layer the matcher finds (``attention_match``) gets a ``ClusteredHeads`` module
with that layer's cluster count k:

- eager attention (``softmax(mask(scale(Q @ Kᵀ))) @ V``, also with the heads merged into the
  batch as OPT's ``bmm`` on ``[B*H, T, D]`` does): the nodes from ``Q @ Kᵀ`` to ``· @ V`` become
  one ``ClusteredEagerAttention`` call on Q, Kᵀ, V and the values the ops between read
  (``attention_match.eager_parts``). Where those ops cannot be taken apart (an op between
  that is not a scale, a mask, a view of batch and heads, a cast or dropout, e.g. a head mask
  or soft-capping, or a node outside reading the scores or probabilities), a ``ClusteredHeads``
  is inserted after the softmax instead, and the pass notes the layer and why;
- ``scaled_dot_product_attention``: the call becomes a ``ClusteredSDPA`` module;
- ``nn.MultiheadAttention``: the module is replaced by ``ClusteredMultiheadAttention``. Inside
  torch's ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer`` (and stacks of them,
  which fx keeps whole as one ``call_module``), the graph gets its own copy of the layer or
  stack (``slow_path_copy``: new module objects sharing the model's parameters, so the model is
  left as it was) with each layer's ``self_attn`` replaced, and with torch's fused fast paths
  (``torch._transformer_encoder_layer_fwd``, nested tensors) turned off in the copy, so that
  every layer runs its ``_sa_block`` and calls its ``self_attn``. A decoder layer's
  cross-attention is left as it is, and the pass notes it.

Reference semantics (what the rewritten graph computes, and what ``runtime.chai_decode``
computes faster): the first ``first_tokens`` (5) query tokens use every head's own attention;
from them the heads are clustered into k clusters (online membership, ``tidal.ir.head_clusters.
membership``; or the fixed offline membership in "static" mode, CHAI-static); every later query
token of a head uses the attention probabilities of its cluster's representative head. V stays
per head. Sharing probabilities is sharing scores (softmax of the representative's Q·Kᵀ), so
with k = H (one head per cluster) the output equals multi-head attention exactly.

``ClusteredSDPA``, ``ClusteredEagerAttention`` and ``ClusteredMultiheadAttention`` skip the
work: after the first tokens they compute scores only for each sequence's representative heads
(``tidal::clustered_attention``, reading K only for the KV heads those use). An eager layer
does so when its scale is a number and its masks add up to an additive mask (a boolean mask
written with -inf, or with ``finfo.min`` in float32/float64/bfloat16, where adding it to a
score gives ``finfo.min`` back), ``nn.MultiheadAttention`` when its attention weights are not
needed (the pass sets ``need_weights=False`` where the graph never reads them). Every head's
scores are computed, and the probabilities shared after the softmax, for calibration (an
``observer``), dropout in training, gradients (the op has no backward), masks or scales the op
cannot take, and with ``representatives_only`` off (the reference, for checks); each module's
``last_route`` says which way its last call went. Layers left with a ``ClusteredHeads`` after
the softmax always compute every head. The smaller K cache is realised by
``tidal.runtime.chai.cache`` (Hugging Face ``generate`` through ``compiled.generate``) and
``tidal.runtime.chai.decode`` (tidal's own decoder).

``calibrate(model, batches)`` runs the offline phase (elbow + accuracy budget) and returns a
``ChaiPlan`` to give back as ``plan=``.

Example:
    >>> import torch, tidal
    >>> from examples.models import llama_small
    >>> from tidal.passes.clustered_attention import ClusteredAttention, chai_modules
    >>> model = llama_small().eval()
    >>> ids = model.example_inputs(2)
    >>> same = tidal.compile(model, ids, passes=[ClusteredAttention(clusters=4)])  # k = H
    >>> torch.testing.assert_close(same(*ids), model(*ids))
    >>> fewer = tidal.compile(model, ids, passes=[ClusteredAttention(clusters=2)])
    >>> fewer.plan.get("clustered_attention").summary()
    '2/2 layers clustered (k per layer: 2,2; online)'
    >>> [m.last_route for m in chai_modules(fewer.graph_module)]  # the eager layers, taken apart
    ['representatives', 'representatives']
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from tidal.ir import meta
from tidal.ir.capture import trace
from tidal.ir.inputs import bind_inputs
from tidal.ir.module_copy import structural_copy
from tidal.ir.head_clusters import CLUSTERINGS, FIRST_TOKENS, Membership, static_membership
from tidal.ir.pass_api import Pass, PassContext, PassResult
from tidal.ir.plans.chai import ChaiPlan, LayerChoice
from tidal.ir.plot import Axis, Series, line_chart, palette
from tidal.passes.attention_match import (AttentionMatch, EagerParts, NotMappable,
                                          eager_parts, find_attention, hidden_attention,
                                          no_attention_message)
from tidal.passes.chai_modules import (ClusteredEagerAttention, ClusteredHeads,  # noqa: F401
                                       ClusteredMultiheadAttention, ClusteredSDPA, share_rows)
from tidal.passes.chai_calibrate import (Budget, HeadStats, choose_counts, elbow,
                                         mildest_useful_k, split_holdout, verdict)

PASS_NAME = "clustered_attention"

NOT_CALIBRATED = ("not calibrated: call calibrate() or pass clusters= (or plan=); "
                  "the model is left unchanged")
"""The pass's only note when it has neither cluster counts nor a plan."""


@dataclass(frozen=True)
class ChaiNodeMeta:
    """What the pass records on a rewritten node, one per attention layer the node runs (a
    tuple: a torch transformer stack kept whole runs several): the layer and its cluster
    count."""

    layer: int
    num_heads: int
    num_kv_heads: int
    k: Optional[int]


def _unique_name(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def slow_path_copy(mod: torch.nn.Module) -> torch.nn.Module:
    """``structural_copy`` of a torch transformer layer or stack with torch's fused inference
    paths off in the copy: no nested-tensor conversion in ``nn.TransformerEncoder``
    (``use_nested_tensor``) and no ``torch._transformer_encoder_layer_fwd`` in
    ``nn.TransformerEncoderLayer`` (``activation_relu_or_gelu`` 0 marks the activation as
    general; the layer's ``_ff_block`` still calls its own ``activation``). Each layer then runs
    its ``_sa_block``, which calls ``self_attn``. Padded positions (``src_key_padding_mask``)
    hold what torch's general path computes there, as in training; torch's nested-tensor
    inference path would return zeros there instead."""
    new = structural_copy(mod)
    for sub in new.modules():
        if isinstance(sub, torch.nn.TransformerEncoder):
            sub.use_nested_tensor = False
        if isinstance(sub, torch.nn.TransformerEncoderLayer):
            sub.activation_relu_or_gelu = 0
    return new


def _own_containers(gm: fx.GraphModule, matches: list[AttentionMatch]) -> None:
    """Give ``gm`` its own ``slow_path_copy`` of every module it calls whole that holds a
    matched ``nn.MultiheadAttention`` below it (a torch transformer layer or stack)."""
    targets = {n.name: n.target for n in gm.graph.nodes if n.op == "call_module"}
    containers = {targets[m.node] for m in matches
                  if m.kind == "module" and m.scope != targets[m.node]}
    for target in containers:
        gm.add_submodule(target, slow_path_copy(gm.get_submodule(target)))


def _weights_unused(node: fx.Node) -> bool:
    """Whether the graph reads only the output of ``nn.MultiheadAttention`` call ``node``, not
    its attention weights (element 1 of the tuple)."""
    return all(u.op == "call_function" and u.target is operator.getitem and
               (u.args[1] == 0 or not u.users) for u in node.users)


def _without_weights(match: AttentionMatch, node: fx.Node) -> Optional[str]:
    """For a ``nn.MultiheadAttention`` the graph calls itself: ``need_weights=False`` when
    the weights are never read (so that the layer may compute only representatives' scores);
    else why not."""
    if node.target != match.scope:
        return None    # inside torch's transformer layers, which ask for no weights
    if not _weights_unused(node):
        return "its attention weights are read (need_weights)"
    if len(node.args) > 4:   # need_weights given by position
        node.args = node.args[:4] + (False,) + node.args[5:]
    else:
        node.kwargs = {**node.kwargs, "need_weights": False}
    return None


def _replace_eager(gm: fx.GraphModule, target: str, parts: EagerParts) -> fx.Node:
    """Replace the nodes of an eager attention (``parts``) by a call of ``target``."""
    nodes = {n.name: n for n in gm.graph.nodes}
    query, output = nodes[parts.query], nodes[parts.output]
    for name in parts.redirect:     # getattr(chain node, "dtype"/"device"): the query's
        r = nodes[name]
        r.args = (query,) + r.args[1:]
    args = tuple(nodes[x] for x in (parts.query, parts.key_t, parts.value) + parts.operands)
    with gm.graph.inserting_before(output):
        new = gm.graph.call_module(target, args)
    new.meta.update(output.meta)
    output.replace_all_uses_with(new)
    for name in reversed(parts.removed):
        gm.graph.erase_node(nodes[name])
    return new


def _rewrite(gm: fx.GraphModule, match: AttentionMatch,
             module: ClusteredHeads) -> tuple[fx.Node, Optional[str]]:
    """Install ``module``'s settings for ``match`` in ``gm``; returns the node that calls the
    layer and, where the layer must compute every head's scores, why (None: after the first
    rows it computes only representatives' scores). A match inside a module ``gm`` calls whole
    needs ``_own_containers`` first."""
    node = next(n for n in gm.graph.nodes if n.name == match.node)
    if match.kind == "module":
        orig = gm.get_submodule(match.scope)
        wrapped = ClusteredMultiheadAttention(orig, match.index, k=module.k, first=module.first,
                                              static=module.static)
        wrapped.clustering = module.clustering
        gm.add_submodule(match.scope, wrapped)
        return node, _without_weights(match, node)
    target = _unique_name(gm, f"chai_attention_{match.index}")
    if match.kind == "sdpa":
        gm.add_submodule(target, module)
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module(target, node.args, node.kwargs)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        return new, None
    try:
        parts = eager_parts(gm, match)
    except NotMappable as e:
        why = str(e)
    else:
        eager = ClusteredEagerAttention(module.layer, module.num_heads, module.num_kv_heads,
                                        parts, module.k, module.first, module.static)
        eager.clustering = module.clustering
        eager.train(gm.training)    # as the graph's nn.Dropout modules its steps stand for
        gm.add_submodule(target, eager)
        return _replace_eager(gm, target, parts), None
    gm.add_submodule(target, module)
    with gm.graph.inserting_after(node):
        new = gm.graph.call_module(target, (node,))
    node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
    return new, why


def chai_modules(gm: torch.nn.Module) -> list[ClusteredHeads]:
    """The ``ClusteredHeads`` modules of a rewritten model, by layer."""
    return sorted((m for m in gm.modules() if isinstance(m, ClusteredHeads)),
                  key=lambda m: m.layer)


def set_counts(gm: torch.nn.Module, counts: dict[int, Optional[int]]) -> None:
    """Set each layer's cluster count (missing layers: unclustered)."""
    for m in chai_modules(gm):
        m.k = counts.get(m.layer)


def _membership_text(gm: fx.GraphModule) -> str:
    lines = ["layer  k  membership of a sample sequence (cluster per head; *representative)"]
    for m in chai_modules(gm):
        if not m.last_membership:
            lines.append(f"{m.layer:>5}  -  unclustered")
            continue
        mem = m.last_membership[0]
        heads = " ".join(f"{c}{'*' if mem.representatives[c] == h else ''}"
                         for h, c in enumerate(mem.labels))
        lines.append(f"{m.layer:>5} {m.k:>2}  {heads}")
    return "\n".join(lines)


def elbow_svg(plan: ChaiPlan) -> str:
    """A small SVG chart of every layer's normalised clustering-error curve against k, its
    elbow (circle) and chosen k (square)."""
    layers = [c for c in plan.layers if c.errors and c.errors[0] > 0]
    colors = palette(len(layers))
    series = []
    for c, hue in zip(layers, colors):
        pts = tuple((k, v / c.errors[0]) for k, v in enumerate(c.errors, 1))
        series.append(Series(f"layer {c.layer}", pts, hue, circles=(pts[c.elbow_k - 1],),
                             squares=() if c.chosen_k is None else (pts[c.chosen_k - 1],)))
    n = max((len(c.errors) for c in layers), default=1)
    top = max((v for s in series for _, v in s.points), default=1.0)
    return line_chart(series, Axis(1, n, "clusters k"),
                      Axis(0, max(top, 1.0), "error / error at k=1"),
                      title="clustering error vs k (normalised), o elbow, [] chosen",
                      width=480, height=300)


class ClusteredAttention(Pass):
    """CHAI: heads clustered per layer, scores shared within a cluster after the first tokens.

    Options: ``clusters`` (one k for every layer, or one k or None per layer), or ``plan`` (a
    ``ChaiPlan`` from :func:`calibrate`); ``mode`` "online" (membership from each sequence's
    first ``first_tokens`` tokens) or "static" (the plan's offline membership); ``clustering``
    "linkage" (default) or "kmeans" (a plan's own wins). With neither
    ``clusters`` nor ``plan`` (e.g. under ``passes="auto"``) the pass is not calibrated: it
    leaves the graph unchanged, returns no plan and says so (``NOT_CALIBRATED``). A layer
    given None in ``clusters`` is installed unclustered (what ``calibrate`` observes through).
    """

    name = PASS_NAME

    def __init__(self, clusters: Union[int, Sequence[Optional[int]], None] = None,
                 plan: Optional[ChaiPlan] = None, mode: str = "online",
                 first_tokens: int = FIRST_TOKENS, clustering: str = "linkage") -> None:
        if clustering not in CLUSTERINGS:
            raise ValueError(f"clustered_attention: clustering must be one of {CLUSTERINGS}, "
                             f"got {clustering!r}")
        self.clustering = clustering
        if mode not in ("online", "static"):
            raise ValueError(f"clustered_attention: mode must be 'online' or 'static', "
                             f"got {mode!r}")
        if mode == "static" and plan is None:
            raise ValueError("clustered_attention: mode='static' needs a plan with the offline "
                             "membership (from calibrate())")
        if first_tokens < 1:
            raise ValueError(f"clustered_attention: first_tokens must be >= 1, got {first_tokens}")
        self.clusters, self.plan, self.mode, self.first = clusters, plan, mode, first_tokens

    def _choices(self, matches: list[AttentionMatch]) -> list[LayerChoice]:
        if self.plan is not None:
            if len(self.plan.layers) != len(matches):
                self.fail(f"the plan has {len(self.plan.layers)} layers but the graph has "
                          f"{len(matches)} attention layers")
            return list(self.plan.layers)
        ks: list[Optional[int]]
        if self.clusters is None or isinstance(self.clusters, int):
            ks = [self.clusters] * len(matches)
        else:
            ks = list(self.clusters)
            if len(ks) != len(matches):
                raise ValueError(f"clustered_attention: clusters has {len(ks)} entries but the "
                                 f"graph has {len(matches)} attention layers")
        return [LayerChoice(m.index, m.scope, m.num_heads, m.num_kv_heads, m.head_dim, k, 0)
                for m, k in zip(matches, ks)]

    def _module(self, match: AttentionMatch, choice: LayerChoice) -> ClusteredHeads:
        """The clustering module for one attention layer."""
        static = None
        if self.mode == "static" and choice.chosen_k is not None:
            static = Membership(choice.static_labels, choice.static_reps)
        mod_cls = ClusteredSDPA if match.kind == "sdpa" else ClusteredHeads
        module = mod_cls(match.index, match.num_heads, match.num_kv_heads, choice.chosen_k,
                         self.first, static)
        module.clustering = self.plan.clustering if self.plan is not None else self.clustering
        return module

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        matches = find_attention(gm, ctx.model)
        if not matches:
            hidden = hidden_attention(gm, matches)
            message = no_attention_message(gm) + "; the model is left unchanged" + (
                f" (nn.MultiheadAttention left as it is at {', '.join(hidden)})" if hidden else "")
            ctx.log(f"{self.name}: {message}")
            return PassResult(gm, notes=(message,))
        if self.clusters is None and self.plan is None:
            ctx.log(f"{self.name}: {NOT_CALIBRATED}")
            return PassResult(gm, notes=(NOT_CALIBRATED,))
        choices = self._choices(matches)
        hidden = hidden_attention(gm, matches)
        _own_containers(gm, matches)
        every_head = []
        for m, c in zip(matches, choices):
            node, why = _rewrite(gm, m, self._module(m, c))
            if why is not None:
                every_head.append(f"layer {m.index} ({m.scope or '<top>'}): {why}")
            recorded = meta.get_pass_meta(node, self.name) or ()
            meta.set_pass_meta(node, self.name, recorded + (
                ChaiNodeMeta(m.index, m.num_heads, m.num_kv_heads, c.chosen_k),))
        gm.graph.lint()
        gm.recompile()
        plan = self.plan or ChaiPlan(tuple(choices), mode=self.mode, first_tokens=self.first,
                                     clustering=self.clustering)
        if plan.mode != self.mode:
            plan = replace(plan, mode=self.mode)
        artifacts = {"chai_clusters.txt": plan.table(), "chai_elbow.svg": elbow_svg(plan)}
        try:
            with torch.no_grad():
                gm(*ctx.example_inputs)
            artifacts["chai_membership.txt"] = _membership_text(gm)
        except Exception as e:  # inspection only: never fail the pass for it
            artifacts["chai_membership.txt"] = f"sample run failed: {type(e).__name__}: {e}"
        kinds = sorted({m.kind for m in matches})
        notes = (f"{len(matches)} attention layers ({', '.join(kinds)}): {plan.summary()}",)
        if hidden:
            notes += (f"left as they are (cross-attention, or inside a module kept whole): "
                      f"nn.MultiheadAttention at {', '.join(hidden)}",)
        if every_head:
            notes += ("every head's scores computed, probabilities shared after the softmax "
                      "(not through tidal::clustered_attention) at " + "; ".join(every_head),)
        return PassResult(gm, plan=plan, artifacts=artifacts, notes=notes)


# --- offline calibration glue (model runs; the planning itself is in chai_calibrate) ---

def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "keys"):
        return out["logits"]
    return out[0]


def perplexity(run: Callable[..., Any], batches: Sequence[tuple]) -> float:
    """Token-level perplexity of a causal LM ``run(*batch) -> logits`` on ``batches`` of
    ``(input_ids,)``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            ids = batch[0]
            logits = _logits(run(*batch))[:, :-1].float()
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                  reduction="sum")
            total, count = total + nll.item(), count + ids[:, 1:].numel()
    return math.exp(total / count)


def clustered_graph(model: torch.nn.Module, example_inputs: Any,
                    pass_: Optional[ClusteredAttention] = None) -> fx.GraphModule:
    """``model`` traced and rewritten by ``pass_`` (default: every layer unclustered)."""
    gm = trace(model, example_inputs)
    inputs = bind_inputs(gm, example_inputs, "example_inputs")
    if pass_ is None:
        pass_ = ClusteredAttention(clusters=[None] * len(find_attention(gm, model)))
    result = pass_(gm, PassContext.for_inputs(inputs, model=model))
    if not chai_modules(result.gm):
        raise ValueError(result.notes[0] if result.notes else no_attention_message(gm))
    return result.gm


def calibrate(model: torch.nn.Module, batches: Sequence[tuple], *,
              budget: Budget = Budget(),
              embed: Optional[Callable[[Any, tuple], torch.Tensor]] = None,
              holdout: Optional[float] = 0.5, margin: float = 0.5,
              model_name: str = "the model", log: Callable[[str], None] = lambda m: None,
              mode: str = "budget") -> ChaiPlan:
    """CHAI's offline phase on ``batches`` (tuples of positional inputs, e.g. ``(ids,)``).

    ``mode="paper"`` is the dissertation's rule as written: each layer's k is the elbow of its
    clustering-error curve, and sequences are clustered online by K-means on their first
    tokens' attention (the plan's ``clustering`` is "kmeans"); the budget is only measured
    (``final_metric``, and ``held_out_metric`` on the held-out share), not enforced.
    ``mode="budget"`` (default) is the rule below.

    Collects every layer's clustering-error curve (k = 1..H) and elbow on all ``batches``,
    then chooses each layer's k (``chai_calibrate.choose_counts``): on the batches
    ``split_holdout`` keeps for choosing, under ``budget.tightened(margin)``, verified on the
    share ``holdout`` held out under ``budget`` itself, backing off the last-accepted layers
    (to their mildest useful k, ``chai_calibrate.mildest_useful_k``, then out) until that
    check fits. ``holdout=None``: no check, every batch chooses (still under the tightened
    budget). With ``budget.metric == "cosine"``,
    ``embed(outputs, batch)`` gives the embeddings compared with the original's.
    """
    if mode not in ("budget", "paper"):
        raise ValueError(f"calibrate: mode must be 'budget' or 'paper', got {mode!r}")
    if holdout is None:
        choose_set, check_set = list(batches), []
    else:
        choose_set, check_set = split_holdout(batches, holdout)
    measured = _measure(clustered_graph(model, batches[0]), batches, choose_set, check_set,
                        budget, embed)
    if mode == "paper":
        return _paper_plan(model, batches, measured, budget, model_name, log)
    return _budget_plan(model, batches, measured, budget, margin, model_name, log)


@dataclass(frozen=True)
class _Measured:
    """What both calibration rules start from: the rewritten graph ``gm`` and its CHAI
    ``modules``, the heads' statistics and error curves (layer -> k = 1..H) over every batch,
    the metric with given counts clustered on the choosing batches (``choose``) and on the
    held-out ones (``check``, None without any), its values with none clustered, and how many
    batches each side has."""

    gm: fx.GraphModule
    modules: list
    stats: HeadStats
    errors: dict
    choose: Callable[[dict], float]
    check: Optional[Callable[[dict], float]]
    baseline: float
    check_baseline: Optional[float]
    choose_batches: int
    check_batches: int


def _measure(gm: fx.GraphModule, batches: Sequence[tuple], choose_set: Sequence[tuple],
             check_set: Sequence[tuple], budget: Budget,
             embed: Optional[Callable[[Any, tuple], torch.Tensor]]) -> _Measured:
    """Run ``gm`` on every batch to collect the heads' statistics, then measure the budget's
    metric with nothing clustered on both sides of the split."""
    modules = chai_modules(gm)
    stats = _head_stats(gm, modules, batches)
    metric_on = _metric_on(gm, batches, budget, embed)
    choose = metric_on(choose_set)
    check = metric_on(check_set) if check_set else None
    baseline = choose({})
    check_baseline = check({}) if check else None
    return _Measured(gm, modules, stats, {m.layer: stats.errors(m.layer) for m in modules},
                     choose, check, baseline, check_baseline, len(choose_set), len(check_set))


def _head_stats(gm: fx.GraphModule, modules: list[ClusteredHeads],
                batches: Sequence[tuple]) -> HeadStats:
    """Every layer's attention probabilities on ``batches``, accumulated (``HeadStats``)."""
    stats = HeadStats()
    for m in modules:
        m.observer = stats.add
    with torch.no_grad():
        for batch in batches:
            gm(*batch)
    for m in modules:
        m.observer = None
    return stats


def _metric_on(gm: fx.GraphModule, batches: Sequence[tuple], budget: Budget,
               embed: Optional[Callable[[Any, tuple], torch.Tensor]]
               ) -> Callable[[Sequence[tuple]], Callable[[dict], float]]:
    """``metric_on(subset)``: the budget's metric on ``subset`` as a function of the counts
    clustered (perplexity, or the mean cosine of ``embed``'s embeddings with the unclustered
    ones, computed here once for every batch)."""
    if budget.metric == "cosine":
        if embed is None:
            raise ValueError("calibrate: budget metric 'cosine' needs embed(outputs, batch)")
        with torch.no_grad():
            reference = {id(b): embed(gm(*b), b) for b in batches}

        def metric_on(subset: Sequence[tuple]) -> Callable[[dict], float]:
            def metric(counts: dict) -> float:
                set_counts(gm, counts)
                with torch.no_grad():
                    sims = [F.cosine_similarity(embed(gm(*b), b), reference[id(b)], dim=-1)
                            for b in subset]
                return torch.cat(sims).mean().item()
            return metric
    else:
        def metric_on(subset: Sequence[tuple]) -> Callable[[dict], float]:
            def metric(counts: dict) -> float:
                set_counts(gm, counts)
                return perplexity(gm, subset)
            return metric
    return metric_on


def _budget_plan(model: torch.nn.Module, batches: Sequence[tuple], measured: _Measured,
                 budget: Budget, margin: float, model_name: str,
                 log: Callable[[str], None]) -> ChaiPlan:
    """``calibrate(mode="budget")``: each layer's k chosen under the tightened budget on the
    choosing batches and verified on the held-out ones (``choose_counts``)."""
    mildest = {m.layer: mildest_useful_k(m.num_heads, m.num_kv_heads)
               for m in measured.modules}
    choice = choose_counts(measured.errors, measured.choose, budget, measured.baseline, log,
                           check=measured.check, check_baseline=measured.check_baseline,
                           margin=margin, mildest=mildest)
    set_counts(measured.gm, {})
    held = measured.check_batches > 0
    log(f"{choice.evaluations} evaluations; {budget.metric} {measured.baseline:.4g} -> "
        f"{choice.metric:.4g} (choose split)"
        + (f", {measured.check_baseline:.4g} -> {choice.held_out:.4g} (held out)"
           if held else ""))
    layers = _layer_choices(model, batches, measured, choice.counts)
    rule = (f"{budget.describe()} (chosen under {budget.tightened(margin).describe()} on "
            f"{measured.choose_batches} batch(es)"
            + (f", verified on {measured.check_batches} held-out batch(es))" if held else ")"))
    return ChaiPlan(tuple(layers), budget=rule, baseline_metric=measured.baseline,
                    final_metric=choice.metric, verdict=verdict(layers, model_name),
                    held_out_baseline=measured.check_baseline or 0.0,
                    held_out_metric=choice.held_out if held else 0.0,
                    backed_off=choice.backed_off, softened=choice.softened)


def _layer_choices(model: torch.nn.Module, batches: Sequence[tuple], measured: _Measured,
                   counts: dict) -> list[LayerChoice]:
    """Each layer's :class:`LayerChoice` for the chosen ``counts`` (with CHAI-static's
    membership from the averaged similarity)."""
    layers = []
    errors = measured.errors
    for m, match in zip(measured.modules, find_attention(trace(model, batches[0]), model)):
        k = counts[m.layer]
        static = (static_membership(measured.stats.similarity(m.layer), k, m.kv_of_head)
                  if k else None)
        layers.append(LayerChoice(
            m.layer, match.scope, m.num_heads, m.num_kv_heads, match.head_dim, k,
            elbow(errors[m.layer]), errors[m.layer],
            static.labels if static else (), static.representatives if static else ()))
    return layers


def _paper_plan(model: torch.nn.Module, batches: Sequence[tuple], measured: _Measured,
                budget: Budget, model_name: str, log: Callable[[str], None]) -> ChaiPlan:
    """``calibrate(mode="paper")``: k at every layer's elbow, K-means membership online; the
    metric measured with them (on the choosing and the held-out batches), not enforced."""
    counts = {m.layer: elbow(measured.errors[m.layer]) for m in measured.modules}
    for m in measured.modules:
        m.clustering = "kmeans"
    final = measured.choose(counts)
    held = measured.check(counts) if measured.check else 0.0
    log(f"paper: k at the elbow {sorted(counts.items())}; {budget.metric} "
        f"{measured.baseline:.4g} -> {final:.4g}")
    layers = _layer_choices(model, batches, measured, counts)
    return ChaiPlan(tuple(layers), clustering="kmeans",
                    budget=f"paper: each layer's k at its elbow, K-means membership; "
                           f"{budget.describe()} measured, not enforced",
                    baseline_metric=measured.baseline, final_metric=final,
                    verdict=verdict(layers, model_name),
                    held_out_baseline=measured.check_baseline or 0.0, held_out_metric=held)
