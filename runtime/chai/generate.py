"""CHAI in Hugging Face ``generate``: the model's own attention modules, clustered, over a
:class:`~tidal.runtime.chai.cache.ClusteredKCache`.

``generation_model(model, plan)`` returns a copy of the Hugging Face causal LM ``model`` (new
module objects sharing its parameters; ``model`` is left as it was) whose attention module of
every layer in the ``ChaiPlan`` (found by the plan's ``scope``, the module path the graph's
attention matcher recorded) projects Q, K and V as the model does and then calls
``ClusteredKCache.attend``: scores only for each sequence's representative heads once its first
five tokens are in, K kept only for the KV heads those read. ``generate(...)`` on the copy uses
a fresh ``ClusteredKCache`` unless given one as ``past_key_values``; greedy and sampling
decoding, batches (membership per sequence) and left-padded batches work. A plain forward
without a cache computes the same clustered attention over the whole sequence (what the
rewritten graph computes).

The attention families are recognised by their modules, not by the model's name:

- rotary (``q_proj``/``k_proj``/``v_proj`` or a fused ``qkv_proj``, ``o_proj``, rotary
  position embeddings, and ``q_norm``/``k_norm`` where the model has them, per head or over
  the whole projection): Llama, Qwen2, Mistral, Gemma, Mixtral, Phi-3, Qwen3, Qwen3-MoE,
  Gemma 3, OLMo 2 and their kin;
- GPT-2 (``c_attn``/``c_proj``; a tuple cache in transformers 4.47);
- OPT (``q_proj``/``k_proj``/``v_proj``/``out_proj`` with ``scaling``; a tuple cache in 4.47).

Anything else is refused with an error naming the module, and so is a module that only looks
like one of them (``check_family``: at one head per cluster the copy must generate what the
model does; StableLM's partial rotary and GPT-BigCode's multi-query cache are refused so).

The same forwards serve transformers 5.x and 4.47: what differs (the keyword the cache comes
under, what an attention module returns, ``generate``'s cache keyword, 4.47's tuple caches) is
read through ``tidal.runtime.chai.hf_compat``. ``generate`` on the copy takes the cache as
``cache=`` or ``past_key_values=`` under either version.

Example:
    >>> import torch, transformers
    >>> from tidal.ir.plans.chai import ChaiPlan, LayerChoice
    >>> from tidal.runtime.chai.generate import generation_model
    >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                                num_hidden_layers=1, num_attention_heads=4,
    ...                                num_key_value_heads=4)
    >>> model = transformers.LlamaForCausalLM(cfg).eval()
    >>> plan = ChaiPlan((LayerChoice(0, "model.layers.0.self_attn", 4, 4, 8, chosen_k=1,
    ...                              elbow_k=1),))
    >>> gen = generation_model(model, plan)
    >>> ids = torch.arange(1, 9).unsqueeze(0)   # no token equals pad_token_id
    >>> cache = gen.new_cache()
    >>> out = gen.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0,
    ...                    past_key_values=cache)
    >>> out.shape, cache[0][0].shape[1]   # K of 1 head of 4
    (torch.Size([1, 11]), 1)
"""
from __future__ import annotations

import inspect
import itertools
import sys
from dataclasses import dataclass, replace
from functools import partial
from types import MethodType
from typing import Any, Callable, Optional

import torch

from tidal.ir.module_copy import structural_copy
from tidal.ir.plans.chai import ChaiPlan
from tidal.runtime.chai import hf_compat
from tidal.runtime.chai.cache import ClusteredKCache, LayerView


@dataclass(frozen=True)
class _Binding:
    """What a clustered attention module knows beyond its own weights: its plan layer, the
    plan (for a cache-less forward), its module path (for errors), the names of its original
    forward's positional parameters (to name the arguments it is called with) and the
    parameter names of its rotary embedding's forward (both read once here, not at every
    decode step)."""

    layer: int
    plan: ChaiPlan
    scope: str
    positional: tuple = ()
    rotary_args: frozenset = frozenset()

    def arguments(self, args: tuple, kwargs: dict) -> dict:
        """The arguments of a call of the module, by name."""
        if len(args) > len(self.positional):
            raise TypeError(f"{self.scope}: {len(args)} positional arguments for "
                            f"{self.positional}")
        return {**dict(zip(self.positional, args)), **kwargs}

    def cache(self, module: torch.nn.Module, past: Any, output_attentions: bool,
              **unsupported: Any) -> ClusteredKCache:
        """The cache to attend with: the one ``generate`` passed (directly, or as a tuple
        model's per-layer ``LayerView``), or a fresh one for a forward without a cache.
        ``unsupported``: arguments that must be None (cross-attention, head masks)."""
        given = sorted(name for name, value in unsupported.items() if value is not None)
        if given:
            raise NotImplementedError(f"{self.scope}: clustered generation does not support "
                                      f"{', '.join(given)}")
        if output_attentions:
            raise NotImplementedError(f"{self.scope}: clustered attention does not return "
                                      f"attention weights (output_attentions=True)")
        if module.training:
            raise ValueError(f"{self.scope}: the clustered generation model is for inference; "
                             f"call .eval() first")
        if isinstance(past, ClusteredKCache):
            return past
        if isinstance(past, LayerView):
            return past.cache
        if past is None:
            return ClusteredKCache(self.plan)
        raise TypeError(f"{self.scope}: clustered attention needs a tidal ClusteredKCache "
                        f"(compiled.new_cache()), got {type(past).__name__}")


def _heads(projections, head_dim: int) -> tuple[torch.Tensor, ...]:
    """``[B, T, heads * D]`` projections as ``[B, heads, T, D]``."""
    return tuple(x.unflatten(-1, (-1, head_dim)).transpose(1, 2) for x in projections)


def _rotary_forward(self, call: dict, tidal: _Binding):
    """Llama-style attention (q/k/v/o projections, rotary embeddings) through the cache;
    ``call``: the module's arguments by name."""
    past = hf_compat.passed_cache(call)
    cache = tidal.cache(self, past, call.get("output_attentions"))
    hidden_states, d = call["hidden_states"], self.head_dim
    if hasattr(self, "qkv_proj"):  # one fused projection, Q then K then V (Phi-3)
        kv_width = self.num_key_value_heads * d
        q, k, v = self.qkv_proj(hidden_states).split(
            (self.qkv_proj.out_features - 2 * kv_width, kv_width, kv_width), -1)
    else:
        q, k, v = (p(hidden_states) for p in (self.q_proj, self.k_proj, self.v_proj))
    norms = getattr(self, "q_norm", None), getattr(self, "k_norm", None)
    per_head = norms[0] is not None and norms[0].weight.shape[-1] == d
    if norms[0] is not None and not per_head:  # over the whole projection (OLMo 2)
        q, k = norms[0](q), norms[1](k)
    q, k, v = _heads((q, k, v), d)
    if per_head:  # over each head (Qwen3, Gemma 3)
        q, k = norms[0](q), norms[1](k)
    rotate = sys.modules[type(self).__module__].apply_rotary_pos_emb
    takes, position_ids = tidal.rotary_args, call.get("position_ids")
    if call.get("position_embeddings") is not None:
        q, k = rotate(q, k, *call["position_embeddings"])
    elif "position_ids" not in takes:  # 4.47's tables by length (Mixtral)
        cos, sin = self.rotary_emb(v, seq_len=int(position_ids.max()) + 1)
        q, k = rotate(q, k, cos, sin, position_ids)
    else:  # a length, where given, picks 4.47 Phi-3's long or short rotary factors as HF does
        length = {"seq_len": cache.get_seq_length(tidal.layer) + q.shape[-2]} \
            if "seq_len" in takes else {}
        q, k = rotate(q, k, *self.rotary_emb(v, position_ids, **length))
    out = cache.attend(tidal.layer, q, k, v, call.get("attention_mask"),
                       getattr(self, "scaling", d ** -0.5))
    out = self.o_proj(out.transpose(1, 2).flatten(2))
    return hf_compat.attention_outputs(out, None, past)


def _gpt2_forward(self, call: dict, tidal: _Binding):
    """GPT-2 attention (fused ``c_attn``) through the cache; the present (4.47) is the cache's
    view."""
    cache = tidal.cache(self, hf_compat.passed_cache(call), call.get("output_attentions"),
                        head_mask=call.get("head_mask"),
                        encoder_hidden_states=call.get("encoder_hidden_states"))
    q, k, v = _heads(self.c_attn(call["hidden_states"]).split(self.split_size, dim=2),
                     self.head_dim)
    scale = self.head_dim ** -0.5 if self.scale_attn_weights else 1.0
    if self.scale_attn_by_inverse_layer_idx:
        scale /= float(self.layer_idx + 1)
    out = cache.attend(tidal.layer, q, k, v, call.get("attention_mask"), scale)
    out = self.resid_dropout(self.c_proj(out.transpose(1, 2).flatten(2)))
    return hf_compat.attention_outputs(out, cache[tidal.layer] if call.get("use_cache") else None)


def _opt_forward(self, call: dict, tidal: _Binding):
    """OPT attention (Q scaled by ``scaling``) through the cache."""
    cache = tidal.cache(self, hf_compat.passed_cache(call), call.get("output_attentions"),
                        layer_head_mask=call.get("layer_head_mask"),
                        key_value_states=call.get("key_value_states"))
    q, k, v = _heads((p(call["hidden_states"]) for p in (self.q_proj, self.k_proj, self.v_proj)),
                     self.head_dim)
    out = cache.attend(tidal.layer, q, k, v, call.get("attention_mask"), self.scaling)
    out = self.out_proj(out.transpose(1, 2).flatten(2))
    return hf_compat.attention_outputs(out, None, cache[tidal.layer])


def _clustered_forward(self, *args: Any, _family: Callable[..., Any], _tidal: _Binding,
                       **kwargs: Any) -> Any:
    """The forward of a clustered attention module: its family's, given the arguments by
    name (a transformers version passes some positionally, under its own names)."""
    return _family(self, _tidal.arguments(args, kwargs), _tidal)


def attention_family(module: torch.nn.Module, scope: str = "") -> Callable[..., Any]:
    """The clustered forward for ``module``'s attention family (see the module docstring);
    ``TypeError`` naming ``scope`` and the class when it is none of them, or when its scores
    are soft-capped (Gemma 2: ``attn_logit_softcapping``, a change too small at one head per
    cluster for :func:`check_family` to see on a random model).

    Example:
        >>> attention_family(torch.nn.Linear(2, 2), "lm_head")
        Traceback (most recent call last):
        ...
        TypeError: clustered generation: the attention module at lm_head (Linear) is not a Llama-style, GPT-2 or OPT attention
    """
    has = lambda *names: all(hasattr(module, n) for n in names)  # noqa: E731
    if getattr(module, "attn_logit_softcapping", None):
        raise TypeError(f"clustered generation: the attention module at {scope or '?'} "
                        f"({type(module).__name__}) soft-caps its scores "
                        f"(attn_logit_softcapping={module.attn_logit_softcapping}), which "
                        f"clustered attention does not")
    if has("c_attn", "c_proj", "split_size") and not getattr(module, "is_cross_attention", 0):
        return _gpt2_forward
    if has("q_proj", "k_proj", "v_proj", "o_proj", "head_dim") or \
            has("qkv_proj", "o_proj", "head_dim", "num_key_value_heads"):
        return _rotary_forward
    if has("q_proj", "k_proj", "v_proj", "out_proj", "scaling") and \
            not getattr(module, "is_cross_attention", False):
        return _opt_forward
    raise TypeError(f"clustered generation: the attention module at {scope or '?'} "
                    f"({type(module).__name__}) is not a Llama-style, GPT-2 or OPT attention")


def generation_model(model: torch.nn.Module, plan: ChaiPlan, check: bool = True
                     ) -> torch.nn.Module:
    """A copy of the Hugging Face causal LM ``model`` whose attention layers in ``plan`` are
    clustered and cached by ``ClusteredKCache`` (see the module docstring). ``check``: first
    make sure that at one head per cluster the copy generates what ``model`` does
    (:func:`check_family`), so that a module only resembling a known family is refused rather
    than decoded wrongly."""
    if not callable(getattr(model, "generate", None)):
        raise TypeError(f"clustered generation needs a Hugging Face causal LM with generate(); "
                        f"{type(model).__name__} has none (for tidal's own decoder of "
                        f"Llama-architecture models see tidal.runtime.chai.decode.ChaiDecoder)")
    if check:
        check_family(model, plan)
    return _clustered_copy(model, plan)


FAMILY_CHECK_TOKENS = 6
"""The prompt length of :func:`check_family`: past the five tokens that fix a membership, so
its decode step reads the pruned cache."""


def check_family(model: torch.nn.Module, plan: ChaiPlan) -> None:
    """Raise ``TypeError`` naming the attention module when the clustered copy of ``model`` at
    one head per cluster (where CHAI is the model itself) does not generate what ``model``
    does: greedy, 2 new tokens from a short prompt, logits compared step by step (relative
    difference at most 1e-3, 5e-2 in half precision)."""
    exact = replace(plan, mode="online", layers=tuple(
        replace(c, chosen_k=c.num_heads, static_labels=(), static_reps=()) for c in plan.layers))
    ids = _probe_prompt(model)
    reference = structural_copy(model).eval()  # the model, without dropout if it is training
    runs = []
    for target in (_clustered_copy(model, exact), reference):
        try:
            with torch.no_grad():
                runs.append(target.generate(
                    ids, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                    pad_token_id=_pad_id(model), return_dict_in_generate=True,
                    output_logits=True))
        except Exception as e:
            if target is reference:
                raise
            raise TypeError(f"clustered generation cannot run {_family_of(model, plan)}: "
                            f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from e
    ours, theirs = runs
    steps = 2 if torch.equal(ours.sequences, theirs.sequences) else 1
    for step in range(steps):
        diff = _relative_difference(ours.logits[step], theirs.logits[step])
        if diff > (5e-2 if ours.logits[step].dtype in (torch.float16, torch.bfloat16) else 1e-3):
            raise TypeError(f"clustered generation cannot run {_family_of(model, plan)}: at one "
                            f"head per cluster its logits differ from the model's own by "
                            f"{diff:.2g} (relative) at step {step + 1}, so this attention is "
                            f"not the family it resembles")


def _family_of(model: torch.nn.Module, plan: ChaiPlan) -> str:
    """``"<Model>'s attention (<Class> at <path>, taken for <family>)"`` of the plan's first
    layer, for errors."""
    scope = plan.layers[0].scope if plan.layers else "?"
    module = model.get_submodule(scope) if plan.layers else model
    family = {_rotary_forward: "a Llama-style attention", _gpt2_forward: "a GPT-2 attention",
              _opt_forward: "an OPT attention"}[attention_family(module, scope)]
    return (f"{type(model).__name__}'s attention ({type(module).__name__} at {scope}, taken "
            f"for {family})")


def _pad_id(model: torch.nn.Module) -> int:
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "pad_token_id", None)
    return 0 if pad is None else int(pad)


def _probe_prompt(model: torch.nn.Module) -> torch.Tensor:
    """``FAMILY_CHECK_TOKENS`` distinct token ids, none of them the pad id, on the model's
    device."""
    vocab = int(model.config.vocab_size)
    pad = _pad_id(model)
    ids = list(itertools.islice((t for t in range(1, vocab) if t != pad), FAMILY_CHECK_TOKENS))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return torch.tensor([ids], device=device)


def _relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    theirs = theirs.double()
    return float((ours.double() - theirs).norm() / theirs.norm().clamp_min(1e-30))


def _clustered_copy(model: torch.nn.Module, plan: ChaiPlan) -> torch.nn.Module:
    """The copy of ``generation_model``, unchecked."""
    gen = structural_copy(model).eval()
    for choice in plan.layers:
        try:
            module = gen.get_submodule(choice.scope)
        except AttributeError:
            raise ValueError(f"clustered generation: the plan's layer {choice.layer} is at "
                             f"{choice.scope!r}, which {type(model).__name__} does not have "
                             f"(a plan calibrated for another model?)") from None
        rotary = getattr(module, "rotary_emb", None)
        binding = _Binding(choice.layer, plan, choice.scope, _positional(type(module).forward),
                           frozenset(inspect.signature(rotary.forward).parameters)
                           if rotary is not None else frozenset())
        module.forward = MethodType(partial(
            _clustered_forward, _family=attention_family(module, choice.scope), _tidal=binding),
            module)
    if not hf_compat.takes_cache_objects(gen):
        # a tuple-cache model (GPT-2, OPT in 4.47): its code indexes past[i][0], which the
        # cache's LayerView answers, and its attention is ours; generate's check that it
        # takes no Cache object is skipped for it
        gen._validate_model_kwargs = MethodType(_validate_without_cache, gen)
    gen.generate = MethodType(_generate, gen)
    gen.new_cache = lambda: ClusteredKCache(plan)
    return gen


def _positional(forward: Callable[..., Any]) -> tuple:
    """The names of ``forward``'s parameters that may be passed by position, after ``self``."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in inspect.signature(forward).parameters.values()
                 if p.kind in kinds)[1:]


def _validate_without_cache(self, model_kwargs: dict) -> None:
    """``generate``'s argument check, without the cache (see ``generation_model``)."""
    rest = {k: v for k, v in model_kwargs.items() if k != "past_key_values"}
    type(self)._validate_model_kwargs(self, rest)


def _generate(self, *args: Any, past_key_values: Optional[ClusteredKCache] = None,
              cache: Optional[ClusteredKCache] = None, **kwargs: Any) -> Any:
    """``generate`` of the model's class with a fresh ``ClusteredKCache`` unless one is given
    (as ``cache=`` or ``past_key_values=``; handed on under this transformers' keyword)."""
    if cache is not None and past_key_values is not None:
        raise TypeError("generate: give the cache once, as cache= or past_key_values=")
    given = past_key_values if cache is None else cache
    if given is None:
        given = self.new_cache()
    elif not isinstance(given, ClusteredKCache):
        raise TypeError(f"generate: the cache (past_key_values=/cache=) must be a tidal "
                        f"ClusteredKCache (compiled.new_cache()), got {type(given).__name__}")
    return type(self).generate(self, *args, **{hf_compat.generate_cache_keyword(): given},
                               **kwargs)
