"""Greedy decoding with a KV cache for :class:`~.llama.LlamaForCausalLM`."""

from __future__ import annotations

import torch
from torch import Tensor

from .llama import LlamaForCausalLM


@torch.no_grad()
def generate(model: LlamaForCausalLM, input_ids: Tensor, max_new_tokens: int) -> Tensor:
    """Greedily append ``max_new_tokens`` tokens to ``input_ids`` ``[B, T]``; returns ``[B, T + new]``.

    The prompt is run once (prefill) and every new token is then fed alone,
    reusing the returned KV cache. The model's train/eval mode is left as is.
    """
    if max_new_tokens <= 0:
        return input_ids
    tokens = [input_ids]
    logits, cache = model(input_ids, model.empty_cache(input_ids.shape[0]))
    for step in range(max_new_tokens):
        next_token = logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens.append(next_token)
        if step + 1 < max_new_tokens:
            logits, cache = model(next_token, cache)
    return torch.cat(tokens, dim=1)
