"""CHAI in Hugging Face ``generate``: the model's own attention modules, clustered, over a
:class:`~tidal.runtime.chai_cache.ClusteredKCache`.

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

- rotary (``q_proj``/``k_proj``/``v_proj`` or a fused ``qkv_proj``, ``o_proj`` and rotary
  position embeddings): Llama, Qwen2, Mistral, Gemma, Mixtral, Phi-3 and their kin;
- GPT-2 (``c_attn``/``c_proj``, a tuple cache in this ``transformers``);
- OPT (``q_proj``/``k_proj``/``v_proj``/``out_proj`` with ``scaling``, a tuple cache).

Anything else is refused with an error naming the module, and so is a module that only looks
like one of them (``check_family``: at one head per cluster the copy must generate what the
model does).

Example:
    >>> import torch, transformers
    >>> from tidal.ir.plans.chai import ChaiPlan, LayerChoice
    >>> from tidal.runtime.chai_generate import generation_model
    >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                                num_hidden_layers=1, num_attention_heads=4,
    ...                                num_key_value_heads=4)
    >>> model = transformers.LlamaForCausalLM(cfg).eval()
    >>> plan = ChaiPlan((LayerChoice(0, "model.layers.0.self_attn", 4, 4, 8, chosen_k=1,
    ...                              elbow_k=1),))
    >>> gen = generation_model(model, plan)
    >>> ids = torch.arange(1, 9).unsqueeze(0)   # no token equals pad_token_id
    >>> out = gen.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0,
    ...                    return_dict_in_generate=True)
    >>> out.sequences.shape, out.past_key_values.key_cache[0].shape[1]   # K of 1 head of 4
    (torch.Size([1, 11]), 1)
"""
from __future__ import annotations

import inspect
import itertools
import sys
from dataclasses import dataclass, replace
from types import MethodType
from typing import Any, Callable, Optional

import torch

from tidal.ir.module_copy import structural_copy
from tidal.ir.plans.chai import ChaiPlan
from tidal.runtime.chai_cache import ClusteredKCache, LayerView


@dataclass(frozen=True)
class _Binding:
    """What a clustered attention module knows beyond its own weights: its plan layer, the
    plan (for a cache-less forward), its module path (for errors) and the parameter names of
    its rotary embedding's forward (read once here, not at every decode step)."""

    layer: int
    plan: ChaiPlan
    scope: str
    rotary_args: frozenset = frozenset()

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


def _rotary_forward(self, hidden_states, attention_mask=None, position_ids=None,
                    past_key_value=None, output_attentions=False, use_cache=False,
                    cache_position=None, position_embeddings=None, *, _tidal: _Binding,
                    **kwargs):
    """Llama-style attention (q/k/v/o projections, rotary embeddings) through the cache."""
    cache = _tidal.cache(self, past_key_value, output_attentions)
    d = self.head_dim
    if hasattr(self, "qkv_proj"):  # one fused projection, Q then K then V (Phi-3)
        q_width, kv_width = self.num_heads * d, self.num_key_value_heads * d
        projections = self.qkv_proj(hidden_states).split((q_width, kv_width, kv_width), -1)
    else:
        projections = (p(hidden_states) for p in (self.q_proj, self.k_proj, self.v_proj))
    q, k, v = _heads(projections, d)
    rotate = sys.modules[type(self).__module__].apply_rotary_pos_emb
    takes = _tidal.rotary_args
    if position_embeddings is not None:
        q, k = rotate(q, k, *position_embeddings)
    elif "position_ids" not in takes:  # the older tables by length (Mixtral here)
        cos, sin = self.rotary_emb(v, seq_len=int(position_ids.max()) + 1)
        q, k = rotate(q, k, cos, sin, position_ids)
    else:  # a length, where given, picks Phi-3's long or short rotary factors as HF does
        length = {"seq_len": cache.get_seq_length(_tidal.layer) + q.shape[-2]} \
            if "seq_len" in takes else {}
        q, k = rotate(q, k, *self.rotary_emb(v, position_ids, **length))
    out = cache.attend(_tidal.layer, q, k, v, attention_mask, getattr(self, "scaling", d ** -0.5))
    out = self.o_proj(out.transpose(1, 2).flatten(2))
    return out, None, past_key_value


def _gpt2_forward(self, hidden_states, layer_past=None, attention_mask=None, head_mask=None,
                  encoder_hidden_states=None, encoder_attention_mask=None, use_cache=False,
                  output_attentions=False, *, _tidal: _Binding, **kwargs):
    """GPT-2 attention (fused ``c_attn``) through the cache; the present is the cache's view."""
    cache = _tidal.cache(self, layer_past, output_attentions, head_mask=head_mask,
                         encoder_hidden_states=encoder_hidden_states)
    q, k, v = _heads(self.c_attn(hidden_states).split(self.split_size, dim=2), self.head_dim)
    scale = self.head_dim ** -0.5 if self.scale_attn_weights else 1.0
    if self.scale_attn_by_inverse_layer_idx:
        scale /= float(self.layer_idx + 1)
    out = cache.attend(_tidal.layer, q, k, v, attention_mask, scale)
    out = self.resid_dropout(self.c_proj(out.transpose(1, 2).flatten(2)))
    return out, (cache[_tidal.layer] if use_cache else None)


def _opt_forward(self, hidden_states, key_value_states=None, past_key_value=None,
                 attention_mask=None, layer_head_mask=None, output_attentions=False, *,
                 _tidal: _Binding, **kwargs):
    """OPT attention (Q scaled by ``scaling``) through the cache."""
    cache = _tidal.cache(self, past_key_value, output_attentions, layer_head_mask=layer_head_mask,
                         key_value_states=key_value_states)
    q, k, v = _heads((p(hidden_states) for p in (self.q_proj, self.k_proj, self.v_proj)),
                     self.head_dim)
    out = cache.attend(_tidal.layer, q, k, v, attention_mask, self.scaling)
    out = self.out_proj(out.transpose(1, 2).flatten(2))
    return out, None, cache[_tidal.layer]


def attention_family(module: torch.nn.Module, scope: str = "") -> Callable[..., Any]:
    """The clustered forward for ``module``'s attention family (see the module docstring);
    ``TypeError`` naming ``scope`` and the class when it is none of them."""
    has = lambda *names: all(hasattr(module, n) for n in names)  # noqa: E731
    if has("c_attn", "c_proj", "split_size") and not getattr(module, "is_cross_attention", 0):
        return _gpt2_forward
    if has("q_proj", "k_proj", "v_proj", "o_proj", "head_dim") or \
            has("qkv_proj", "o_proj", "head_dim", "num_heads", "num_key_value_heads", "rotary_emb"):
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
                        f"Llama-architecture models see tidal.runtime.chai_decode.ChaiDecoder)")
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
        forward = attention_family(module, choice.scope)
        rotary = getattr(module, "rotary_emb", None)
        binding = _Binding(choice.layer, plan, choice.scope, frozenset(
            inspect.signature(rotary.forward).parameters) if rotary is not None else frozenset())
        module.forward = MethodType(
            lambda self, *a, _f=forward, _b=binding, **kw: _f(self, *a, _tidal=_b, **kw), module)
    if not getattr(gen, "_supports_cache_class", True):
        # a tuple-cache model (GPT-2, OPT here): its code indexes past[i][0], which the
        # cache's LayerView answers, and its attention is ours; generate's check that it
        # takes no Cache object is skipped for it
        gen._validate_model_kwargs = MethodType(_validate_without_cache, gen)
    gen.generate = MethodType(_generate, gen)
    gen.new_cache = lambda: ClusteredKCache(plan)
    return gen


def _validate_without_cache(self, model_kwargs: dict) -> None:
    """``generate``'s argument check, without the cache (see ``generation_model``)."""
    rest = {k: v for k, v in model_kwargs.items() if k != "past_key_values"}
    type(self)._validate_model_kwargs(self, rest)


def _generate(self, *args: Any, past_key_values: Optional[ClusteredKCache] = None,
              **kwargs: Any) -> Any:
    """``generate`` of the model's class with a fresh ``ClusteredKCache`` unless one is given."""
    if past_key_values is None:
        past_key_values = self.new_cache()
    elif not isinstance(past_key_values, ClusteredKCache):
        raise TypeError(f"generate: past_key_values must be a tidal ClusteredKCache "
                        f"(compiled.new_cache()), got {type(past_key_values).__name__}")
    return type(self).generate(self, *args, past_key_values=past_key_values, **kwargs)
