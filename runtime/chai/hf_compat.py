"""Everything CHAI's generation reads of Hugging Face ``transformers`` that differs between the
versions it runs on, each behind one small function: transformers 5.x (the ``hf`` extra) and
4.47 (the previous pin, still tested).

=============================  ===================================  ===========================
what                           transformers 4.47                    transformers 5.x
=============================  ===================================  ===========================
a ``DynamicCache``'s K/V       ``key_cache`` / ``value_cache``      ``layers[i].keys`` /
                               lists                                ``.values`` (``DynamicLayer``)
the cache an attention         ``past_key_value=`` (``layer_past``  ``cache=``
module is called with          for GPT-2)
what an attention returns      ``(out, weights, cache)`` (GPT-2:    ``(out, weights)``
                               ``(out, cache)``)
``generate``'s cache keyword   ``past_key_values=``                 ``cache=`` (the old name
                                                                    deprecated)
rotary settings of a config    ``rope_theta``, ``rope_scaling``     ``rope_parameters``
GPT-2 / OPT caches             tuples (``_supports_cache_class``    ``Cache`` objects
                               False)
``from_pretrained``'s dtype    ``torch_dtype=``                     ``dtype=`` (the old name
                                                                    deprecated)
=============================  ===================================  ===========================

Each choice is made when the function is called, from what the running ``transformers`` (or
the object handed in) has, never cached here, so one code path in ``tidal.runtime.chai.cache``,
``chai_generate`` and ``chai_decode`` serves both.

Example:
    >>> import torch
    >>> from transformers import DynamicCache, LlamaConfig
    >>> from tidal.runtime.chai import hf_compat
    >>> cache = DynamicCache()
    >>> hf_compat.set_layer_kv(cache, 1, torch.zeros(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    >>> [tuple(k.shape) for k, v in hf_compat.layers_kv(cache)]      # layer 0: a placeholder
    [(0,), (1, 2, 3, 4)]
    >>> hf_compat.rope(LlamaConfig(rope_theta=5000.0))
    Rope(theta=5000.0, kind='default', partial=1.0)
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import transformers


def transformers_major() -> int:
    """The running ``transformers``' major version (4 or 5)."""
    return int(transformers.__version__.split(".")[0])


# --- the KV cache ---

def _layered(cache: Any) -> bool:
    """Whether ``cache`` keeps one layer object per layer (transformers 5's ``Cache.layers``)
    rather than 4.47's ``key_cache``/``value_cache`` lists."""
    return hasattr(cache, "layers")


def layers_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's ``(K, V)`` held by a ``DynamicCache`` of either version (a layer not reached
    yet: empty tensors on the device of what the cache holds)."""
    if not _layered(cache):
        return list(zip(cache.key_cache, cache.value_cache))
    held = [(layer.keys, layer.values) for layer in cache.layers]
    device = next((v.device for _, v in held if v is not None), None)
    empty = torch.empty(0, device=device)
    return [(empty, empty) if v is None else (k, v) for k, v in held]


def layer_kv(cache: Any, layer: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Layer ``layer``'s ``(K, V)``, or None when the cache holds nothing for it yet.

    Example:
        >>> from transformers import DynamicCache
        >>> layer_kv(DynamicCache(), 0) is None
        True
    """
    if not _layered(cache):
        if layer >= len(cache.key_cache) or not cache.value_cache[layer].numel():
            return None
        return cache.key_cache[layer], cache.value_cache[layer]
    if layer >= len(cache.layers) or cache.layers[layer].values is None:
        return None
    entry = cache.layers[layer]
    return (entry.keys, entry.values) if entry.values.numel() else None


def set_layer_kv(cache: Any, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``key``/``value`` what the cache holds for layer ``layer`` (earlier layers not
    reached get placeholders on ``value``'s device)."""
    if not _layered(cache):
        while len(cache.key_cache) <= layer:
            cache.key_cache.append(value.new_empty(0))
            cache.value_cache.append(value.new_empty(0))
        cache.key_cache[layer], cache.value_cache[layer] = key, value
        return
    from transformers.cache_utils import DynamicLayer

    while len(cache.layers) <= layer:
        cache.layers.append(DynamicLayer())
    entry = cache.layers[layer]
    if not entry.is_initialized:
        entry.lazy_initialization(key, value)
    entry.keys, entry.values = key, value


def count_seen(cache: Any, tokens: int) -> None:
    """Add ``tokens`` to the count of tokens seen that 4.47's ``DynamicCache`` keeps
    (``_seen_tokens``; transformers 5 has none)."""
    if hasattr(cache, "_seen_tokens"):
        cache._seen_tokens += tokens


# --- attention modules and generate ---

CACHE_KEYWORDS = ("cache", "past_key_value", "past_key_values", "layer_past")
"""The keywords under which a transformers version hands an attention module its cache: 5.x
``cache``; 4.47 ``past_key_value`` (rotary families, OPT) or ``layer_past`` (GPT-2)."""


def passed_cache(kwargs: dict) -> Any:
    """The cache among an attention module's keyword arguments ``kwargs`` (removed from
    them), whichever name this version uses; None when there is none.

    Example:
        >>> kw = {"cache": "c", "use_cache": True}
        >>> passed_cache(kw), kw
        ('c', {'use_cache': True})
    """
    found = [kwargs.pop(name) for name in CACHE_KEYWORDS if name in kwargs]
    return next((c for c in found if c is not None), None)


def attention_outputs(out: torch.Tensor, *legacy: Any) -> tuple:
    """What an attention module's forward returns: ``(out, None)`` (no attention weights) in
    transformers 5, ``(out, *legacy)`` in 4.47, whose modules also return their cache
    (``legacy``: what follows ``out`` in that family's 4.47 tuple)."""
    return (out, None) if transformers_major() >= 5 else (out, *legacy)


def generate_cache_keyword() -> str:
    """The keyword ``generate`` takes a cache under: ``cache`` in transformers 5 (where
    ``past_key_values`` is deprecated), ``past_key_values`` in 4.47."""
    return "cache" if transformers_major() >= 5 else "past_key_values"


def dtype_keyword() -> str:
    """The keyword ``from_pretrained`` takes the weights' dtype under: ``dtype`` in
    transformers 5 (where ``torch_dtype`` is deprecated), ``torch_dtype`` in 4.47."""
    return "dtype" if transformers_major() >= 5 else "torch_dtype"


def takes_cache_objects(model: torch.nn.Module) -> bool:
    """Whether ``model`` takes ``Cache`` objects; False for 4.47's tuple-cache models (GPT-2,
    OPT), whose ``generate`` refuses a ``Cache`` in its argument check."""
    return bool(getattr(model, "_supports_cache_class", True))


# --- configs ---

class Rope(NamedTuple):
    """A config's rotary settings: base ``theta``, ``kind`` (``"default"``, ``"linear"``,
    ``"llama3"``, ...) and the ``partial`` fraction of each head rotated."""

    theta: float
    kind: str
    partial: float


def rope(config: Any) -> Rope:
    """The rotary settings of ``config``: transformers 5's ``rope_parameters``, else 4.47's
    ``rope_theta``/``rope_scaling`` (``partial_rotary_factor`` beside them), else the defaults
    (θ = 10000, whole heads; tidal's zoo configs name ``rope_theta`` only). Settings per
    layer type (Gemma 3's ``{"full_attention": ..., "sliding_attention": ...}``) are a
    ``kind`` that names them.

    Example:
        >>> from types import SimpleNamespace
        >>> rope(SimpleNamespace(rope_theta=1e5))
        Rope(theta=100000.0, kind='default', partial=1.0)
    """
    params = getattr(config, "rope_parameters", None)
    if params and all(isinstance(v, dict) for v in params.values()):  # one per layer type
        return Rope(float("nan"), "per layer type (" + ", ".join(sorted(params)) + ")", 1.0)
    if params is None:
        scaling = getattr(config, "rope_scaling", None) or {}
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0),
                  "rope_type": scaling.get("rope_type", scaling.get("type", "default")),
                  "partial_rotary_factor": getattr(config, "partial_rotary_factor", 1.0)}
    return Rope(float(params.get("rope_theta", 10000.0)), str(params.get("rope_type", "default")),
                float(params.get("partial_rotary_factor", 1.0) or 1.0))
