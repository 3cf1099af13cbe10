"""Greedy decoding checked up to rounding: two computations of the same logits (a KV-cached
decode and a full forward, fused and unfused weights) may round a near-tie between two tokens
either way, so a generated token is accepted when its logit is within ``atol`` of the best."""
import torch


def assert_greedy(tokens, prompt_len, logits_of, atol=1e-4):
    """Assert every token of ``tokens`` ``[B, T]`` after the first ``prompt_len`` is a greedy
    choice, up to ``atol``, of ``logits_of(tokens[:, :-1])`` (a full forward, ``[B, T-1, V]``)
    at the position before it."""
    with torch.no_grad():
        logits = logits_of(tokens[:, :-1])[:, prompt_len - 1:]
    chosen = logits.gather(-1, tokens[:, prompt_len:, None])[..., 0]
    short = logits.max(dim=-1).values - chosen
    assert bool((short <= atol).all()), f"not greedy: logit short of the best by {short.max()}"
