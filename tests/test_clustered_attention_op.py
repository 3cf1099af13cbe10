"""``tidal::clustered_attention``: with one head per cluster it is scaled-dot-product attention
(MHA and GQA, causal, boolean and additive masks); with clusters every head gets its
representative's probabilities and its own V, computing scores for the representatives only;
its fake kernel gives the shapes (make_fx, torch.export); ``ClusteredSDPA`` computes only
representative heads' scores after the first tokens and equals the all-heads reference."""
import pytest
import torch
import torch.nn.functional as F

from tidal.ir import clustered_attention_op as cao
from tidal.passes.clustered_attention import ClusteredSDPA, share_rows

TOL = dict(rtol=1e-5, atol=1e-6)


def _qkv(heads, kv_heads, tq=6, tk=9, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, tq, 16, generator=g),
            torch.randn(batch, kv_heads, tk, 16, generator=g),
            torch.randn(batch, kv_heads, tk, 12, generator=g))


def _reference(q, k, v, rep, scale, causal, mask):
    """Every head's probabilities computed, each head then takes its representative's."""
    heads = q.shape[1]
    k, v = (x.repeat_interleave(heads // x.shape[1], 1) for x in (k, v))
    scores = q @ k.transpose(-1, -2) * scale
    tq, tk = scores.shape[-2:]
    if causal:
        scores = scores.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq),
                                    float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
            else scores + mask
    return share_rows(scores.softmax(-1), rep, 0) @ v


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tq,tk", [(6, 9), (40, 40), (30, 45)])  # decoding rows; prefill
def test_one_head_per_cluster_is_scaled_dot_product_attention(heads, kv_heads, causal, tq, tk):
    q, k, v = _qkv(heads, kv_heads, tq=tq, tk=tk)
    v = v[..., :16]  # the fused kernel's value width is the head's
    rep = torch.arange(heads).repeat(2, 1)
    keep = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq) if causal else None
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(heads // kv_heads, 1),
                                          v.repeat_interleave(heads // kv_heads, 1),
                                          attn_mask=keep, scale=0.25)
    got = torch.ops.tidal.clustered_attention(q, k, v, rep, 0.25, causal, None)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("tq,tk,causal", [(6, 9, False), (40, 40, True), (30, 45, True)])
def test_clusters_share_their_representatives_probabilities(mask_kind, tq, tk, causal):
    # a cluster whose members read different V heads (rows 6..7 of the first sequence) and
    # one that spans both KV heads (the second sequence): short and long (fused) blocks
    q, k, v = _qkv(8, 2, tq=tq, tk=tk)
    v = v[..., :16]
    rep = torch.tensor([[0, 0, 2, 2, 4, 4, 4, 7], [1, 1, 1, 1, 5, 5, 5, 5]])
    g = torch.Generator().manual_seed(1)
    mask = {"none": None, "bool": torch.rand(2, 1, tq, tk, generator=g) > 0.2,
            "additive": torch.randn(2, 1, tq, tk, generator=g)}[mask_kind]
    if mask_kind == "bool":
        mask[..., 0] = True  # every row keeps a key
    got = torch.ops.tidal.clustered_attention(q, k, v, rep, 0.25, causal, mask)
    torch.testing.assert_close(got, _reference(q, k, v, rep, 0.25, causal, mask), **TOL)
    # the scores of 4 + 2 representative heads, not 2 x 8
    assert cao.score_heads(rep) == 6


def test_fake_kernel_shapes_make_fx_and_export():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        q, k, v = torch.empty(3, 8, 5, 16), torch.empty(3, 2, 11, 16), torch.empty(3, 2, 11, 4)
        out = torch.ops.tidal.clustered_attention(q, k, v, torch.zeros(3, 8, dtype=torch.long),
                                                  1.0, True, None)
        assert tuple(out.shape) == (3, 8, 5, 4)

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, rep):
            return torch.ops.tidal.clustered_attention(q, k, v, rep, 0.25, True, None)

    args = _qkv(4, 2) + (torch.tensor([[0, 0, 2, 2], [1, 1, 1, 1]]),)
    ops = [n.target for n in torch.export.export(Attend(), args).graph.nodes
           if n.op == "call_function"]
    assert ops == [torch.ops.tidal.clustered_attention.default]
    gm = make_fx(Attend())(*args)
    torch.testing.assert_close(gm(*args), Attend()(*args), rtol=0, atol=0)


def test_bad_shapes_and_memberships_are_named():
    q, k, v = _qkv(4, 2)
    with pytest.raises(ValueError, match="rep_of_head must be"):
        torch.ops.tidal.clustered_attention(q, k, v, torch.zeros(2, 3, dtype=torch.long), 1.0,
                                            False, None)
    with pytest.raises(ValueError, match="cannot share"):
        torch.ops.tidal.clustered_attention(q, k[:, :1].expand(2, 3, 9, 16), v, torch.zeros(
            2, 4, dtype=torch.long), 1.0, False, None)
    with pytest.raises(ValueError, match="represent itself"):
        torch.ops.tidal.clustered_attention(q, k, v, torch.tensor([[1, 0, 2, 3]] * 2), 1.0,
                                            False, None)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("tokens", [12, 40])
def test_clustered_sdpa_scores_only_representatives_and_equals_the_reference(heads, kv_heads,
                                                                             tokens):
    # after the first 5 tokens only the representatives' scores are computed; the result is the
    # all-heads reference (every head's probabilities computed, then shared), causal and padded
    q, k, v = _qkv(heads, kv_heads, tq=tokens, tk=tokens)
    v = v[..., :16]
    layer = ClusteredSDPA(0, heads, kv_heads, k=2)
    pad = torch.zeros(2, 1, 1, tokens)
    pad[1, ..., :3] = torch.finfo(torch.float32).min  # left padding, as Hugging Face masks it
    fast = layer(q, k, v, attn_mask=pad, is_causal=True, enable_gqa=True)
    reps = torch.tensor([m.rep_of_head for m in layer.last_membership])
    try:
        layer.observer = lambda i, probs: None  # calibration: every head spelled out
        slow = layer(q, k, v, attn_mask=pad, is_causal=True, enable_gqa=True)
    finally:
        layer.observer = None
    assert cao.score_heads(reps) == 2 * 2 < 2 * heads  # 2 representatives per sequence
    torch.testing.assert_close(fast, slow, **TOL)
    assert all(len(m.representatives) == 2 for m in layer.last_membership)


def test_keys_a_model_repeated_for_gqa_are_read_once():
    # Hugging Face repeats K/V heads (repeat_kv) before its SDPA call: the layer reads each KV
    # head once (so a cluster within one KV group scores its representative once), and the
    # result still equals the all-heads reference
    q, k, v = _qkv(8, 2, tq=40, tk=40)
    v = v[..., :16]
    k_rep, v_rep = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    layer = ClusteredSDPA(0, 8, 2, k=2)
    assert torch.equal(layer._kv_heads(k_rep), k) and layer._kv_heads(q).shape[1] == 8
    fast = layer(q, k_rep, v_rep, is_causal=True)
    layer.observer = lambda i, probs: None
    slow = layer(q, k_rep, v_rep, is_causal=True)
    torch.testing.assert_close(fast, slow, **TOL)
