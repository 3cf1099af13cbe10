"""clustered_attention: with one head per cluster the model is unchanged (also for torch's
nn.TransformerEncoder / DecoderLayer, which fx keeps whole); membership is fixed after the first
5 tokens; the decode runtime matches the graph semantics and keeps K only for the KV heads
representatives read."""
import dataclasses
import math

import pytest
import torch

import tidal
from tidal.ir.head_clusters import Membership, cosine_similarity, head_features
from tidal.passes.clustered_attention import ClusteredAttention, ClusteredHeads, chai_modules
from tidal.runtime.chai.decode import ChaiDecoder
from examples.models import LlamaConfig, LlamaForCausalLM, bert_small, llama_small

from greedy import assert_greedy
from test_attention_match import MHA, SDPA, TorchDecoderLayer, TorchEncoder, hf_gpt2, hf_llama

TOL = dict(rtol=1e-5, atol=1e-5)


def compiled(model, inputs, **kw):
    return tidal.compile(model, inputs, passes=[ClusteredAttention(**kw)])


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out["logits"]


@pytest.mark.parametrize("name", ["zoo_llama", "zoo_bert", "hf_llama", "hf_gpt2", "mha", "sdpa"])
def test_one_head_per_cluster_equals_original(name):
    torch.manual_seed(0)
    if name == "zoo_llama":
        model, inputs, heads = llama_small().eval(), (torch.randint(0, 256, (2, 12)),), 4
    elif name == "zoo_bert":
        model, inputs, heads = bert_small().eval(), (torch.randint(0, 1000, (2, 12)),), 4
    elif name == "hf_llama":
        model, inputs, heads = hf_llama(), {"input_ids": torch.randint(0, 128, (2, 12))}, 4
    elif name == "hf_gpt2":
        model, inputs, heads = hf_gpt2(), {"input_ids": torch.randint(0, 100, (2, 12))}, 4
    elif name == "mha":
        model, inputs, heads = MHA().eval(), (torch.randn(2, 9, 16),), None
    else:
        model, inputs, heads = SDPA().eval(), (torch.randn(2, 9, 16),), 4
    args = tuple(inputs.values()) if isinstance(inputs, dict) else inputs
    counts = heads if heads else [4, 2]
    c = compiled(model, inputs, clusters=counts)
    mods = chai_modules(c.graph_module)
    assert mods and all(m.k == m.num_heads for m in mods)
    with torch.no_grad():
        ref = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        ref = ref[0] if isinstance(ref, tuple) else _logits(ref)
        out = c(*args)
        out = out[0] if isinstance(out, tuple) else _logits(out)
    torch.testing.assert_close(out, ref, **TOL)
    assert all(len(m.last_membership) == args[0].shape[0] for m in mods)  # the path really ran
    assert all(m.last_route == "representatives" for m in mods)  # tidal::clustered_attention


class PaddedMHA(torch.nn.Module):
    """A sequence-first ``nn.MultiheadAttention`` with an optional key padding mask, on
    batch-first inputs."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 4)

    def forward(self, x, pad=None):
        x = x.transpose(0, 1)
        return self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0].transpose(0, 1)


def padded_inputs():
    """``x`` ``[2, 9, 16]`` and a key padding mask hiding the last 2 positions of sample 1."""
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 7:] = True
    return torch.randn(2, 9, 16), pad


def assert_torch_layers_untouched(model):
    """The compiled graph rewrote its own copies: the model's layers keep their attention and
    torch's fast paths."""
    for mod in model.modules():
        if isinstance(mod, (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)):
            assert type(mod.self_attn) is torch.nn.MultiheadAttention
        if isinstance(mod, torch.nn.TransformerEncoderLayer):
            assert mod.activation_relu_or_gelu == 1


def test_padded_sequence_first_mha_one_head_per_cluster_equals_original():
    torch.manual_seed(0)
    model, (x, pad) = PaddedMHA().eval(), padded_inputs()
    c = compiled(model, (x, pad), clusters=4)
    with torch.no_grad():
        torch.testing.assert_close(c(x, pad), model(x, pad), **TOL)
    (m,) = chai_modules(c.graph_module)
    assert len(m.last_membership) == 2


@pytest.mark.parametrize("masks", ["none", "padding", "padding+causal"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_transformer_encoder_one_head_per_cluster_equals_original(batch_first, norm_first,
                                                                        masks):
    torch.manual_seed(0)
    model = TorchEncoder(batch_first, norm_first, causal="causal" in masks).eval()
    x, pad = padded_inputs()
    inputs = (x, pad) if "padding" in masks else (x,)
    c = compiled(model, inputs, clusters=4)
    (record,) = [r for r in c.records if r.name == "clustered_attention"]
    assert record.notes == ("2 attention layers (module): 0/2 layers clustered "
                            "(k per layer: 4,4; online)",)
    mods = chai_modules(c.graph_module)
    assert [m.layer for m in mods] == [0, 1] and all(m.k == 4 for m in mods)
    with torch.no_grad():
        ref = model(*inputs)   # eval, no grad: torch's fused encoder-layer kernel
        out = c(*inputs)
    torch.testing.assert_close(out, ref, **TOL)
    assert all(len(m.last_membership) == 2 for m in mods)     # the CHAI path really ran
    assert_torch_layers_untouched(model)
    with torch.no_grad():
        torch.testing.assert_close(model(*inputs), ref, rtol=0, atol=0)


@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_transformer_encoder_fewer_clusters_change_only_later_tokens(batch_first):
    """Causal, so that no later token reaches the first five through the next layer."""
    torch.manual_seed(0)
    model, (x, pad) = TorchEncoder(batch_first, causal=True).eval(), padded_inputs()
    c = compiled(model, (x, pad), clusters=1)
    with torch.no_grad():
        ref, out = model(x, pad), c(x, pad)
    torch.testing.assert_close(out[:, :5], ref[:, :5], **TOL)
    assert not torch.allclose(out[:, 5:], ref[:, 5:], atol=1e-4)
    assert all(len(set(m.last_membership[0].labels)) == 1 for m in chai_modules(c.graph_module))


def test_torch_transformer_encoder_nested_tensor_path_differs_only_at_padding():
    """torch's inference path with nested tensors (the default enable_nested_tensor) returns
    zeros at padded positions; the rewritten encoder computes them, as torch's general path
    does. Every other position is the original's."""
    torch.manual_seed(0)
    model, (x, pad) = TorchEncoder(nested=True).eval(), padded_inputs()
    c = compiled(model, (x, pad), clusters=4)
    with torch.no_grad():
        ref, out = model(x, pad), c(x, pad)
    torch.testing.assert_close(out[~pad], ref[~pad], **TOL)
    assert torch.all(ref[pad] == 0) and not torch.all(out[pad] == 0)


def test_torch_decoder_layer_clusters_self_attention_and_leaves_cross_attention():
    torch.manual_seed(0)
    model = TorchDecoderLayer().eval()
    x, memory = torch.randn(2, 9, 16), torch.randn(2, 7, 16)
    same, one = compiled(model, (x, memory), clusters=4), compiled(model, (x, memory), clusters=1)
    (record,) = [r for r in same.records if r.name == "clustered_attention"]
    assert "layer.multihead_attn" in record.notes[1] and "cross-attention" in record.notes[1]
    with torch.no_grad():
        ref = model(x, memory)
        torch.testing.assert_close(same(x, memory), ref, **TOL)
        out = one(x, memory)
    torch.testing.assert_close(out[:, :5], ref[:, :5], **TOL)
    assert not torch.allclose(out[:, 5:], ref[:, 5:], atol=1e-4)
    (m,) = chai_modules(one.graph_module)
    assert m.last_membership and type(one.graph_module.layer.multihead_attn) is \
        torch.nn.MultiheadAttention
    assert_torch_layers_untouched(model)


def test_fewer_clusters_change_only_tokens_after_the_first_five():
    torch.manual_seed(0)
    model = llama_small().eval()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        ref = model(ids)
        out = compiled(model, (ids,), clusters=1)(ids)
    torch.testing.assert_close(out[:, :5], ref[:, :5], **TOL)
    assert not torch.allclose(out[:, 5:], ref[:, 5:], atol=1e-4)


def test_membership_depends_only_on_the_first_five_tokens():
    torch.manual_seed(0)
    model = llama_small().eval()
    a = torch.randint(0, 256, (1, 16))
    b = torch.cat((a[:, :5], torch.randint(0, 256, (1, 11))), dim=1)
    c = compiled(model, (a,), clusters=2)
    with torch.no_grad():
        c(a)
        first = [m.last_membership for m in chai_modules(c.graph_module)]
        c(b)
        second = [m.last_membership for m in chai_modules(c.graph_module)]
    assert first == second


def test_decoder_membership_fixed_after_token_five():
    torch.manual_seed(0)
    dec = ChaiDecoder(llama_small().eval(), counts=2)
    logits, state = dec.prefill(torch.randint(0, 256, (1, 5 + 1)), max_len=20)
    fixed = dec.memberships(state)
    assert all(m is not None and len(set(m.labels)) == 2 for m in fixed)
    for _ in range(8):
        logits = dec.step(logits[:, -1:].argmax(-1), state)
        assert dec.memberships(state) == fixed


@pytest.mark.parametrize("source", ["zoo", "hf"])
def test_decoder_unclustered_equals_model(source):
    torch.manual_seed(0)
    model = llama_small().eval() if source == "zoo" else hf_llama()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 10))
    dec = ChaiDecoder(model, counts=model.config.num_attention_heads)  # one head per cluster
    with torch.no_grad():
        full = model(ids) if source == "zoo" else model(input_ids=ids).logits
    logits, state = dec.prefill(ids[:1, :8])
    steps = [logits] + [dec.step(ids[:1, t:t + 1], state) for t in (8, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:1], **TOL)
    plain = ChaiDecoder(model)
    torch.testing.assert_close(plain.prefill(ids)[0], full, **TOL)
    torch.testing.assert_close(plain.prefill(ids, last_only=True)[0], full[:, -1:], **TOL)
    if source == "zoo":
        assert_greedy(plain.generate(ids, 5), ids.shape[1], model)


def test_decoder_clustered_matches_graph_semantics():
    """Prefill and every decode step give the clustered graph's full-sequence logits."""
    torch.manual_seed(0)
    model = llama_small().eval()
    ids = torch.randint(0, 256, (1, 14))
    with torch.no_grad():
        graph = compiled(model, (ids,), clusters=[2, 1])(ids)
    dec = ChaiDecoder(model, counts=[2, 1])
    logits, state = dec.prefill(ids[:, :9])
    steps = [logits] + [dec.step(ids[:, t:t + 1], state) for t in range(9, 14)]
    torch.testing.assert_close(torch.cat(steps, 1), graph, **TOL)


def test_with_clusters_shares_weights_and_decodes_like_a_fresh_decoder():
    torch.manual_seed(0)
    model = llama_small().eval()
    ids = torch.randint(0, 256, (1, 12))
    full = ChaiDecoder(model)
    derived = full.with_clusters(counts=[2, 1])
    assert derived.layers[0].wqkv is full.layers[0].wqkv      # shared, not copied
    assert full.counts == [None, None]                        # the original is unchanged
    assert torch.equal(derived.generate(ids, 4), ChaiDecoder(model, counts=[2, 1]).generate(ids, 4))
    with pytest.raises(ValueError, match="layer 1"):
        full.with_clusters(counts=[2, 9])


def test_k_cache_shrinks_by_exactly_the_dropped_heads():
    cfg = dataclasses.replace(LlamaConfig(), vocab_size=64, hidden_size=48, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6,
                              max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, example_seq_len=16).eval()
    ids = torch.randint(0, 64, (1, 10))
    full = ChaiDecoder(model)
    chai = ChaiDecoder(model, counts=[2, None])
    _, s_full = full.prefill(ids, max_len=32)
    _, s_chai = chai.prefill(ids, max_len=32)
    per_head = 1 * 32 * cfg.head_dim * 4           # batch x positions x head_dim x fp32
    assert full.k_cache_bytes(s_full) - chai.k_cache_bytes(s_chai) == (6 - 2) * per_head
    assert [v.shape for v in s_chai.values] == [v.shape for v in s_full.values]  # V kept


def test_gqa_k_cache_keeps_kv_heads_of_representatives():
    torch.manual_seed(0)
    dec = ChaiDecoder(llama_small().eval(), counts=1)       # 4 heads, 2 KV heads
    _, state = dec.prefill(torch.randint(0, 256, (1, 8)), max_len=16)
    for mem, keys in zip(dec.memberships(state), state.keys):
        kept = {dec.kv_of_head[r] for r in mem.representatives}
        assert keys.shape[1] == len(kept) == 1


def test_static_mode_uses_the_plan_membership():
    torch.manual_seed(0)
    model = llama_small().eval()
    ids = (torch.randint(0, 256, (2, 12)),)
    plan = compiled(model, ids, clusters=2).plan.get("clustered_attention")
    layers = tuple(dataclasses.replace(c, static_labels=(0, 1, 1, 1), static_reps=(0, 1))
                   for c in plan.layers)
    plan = dataclasses.replace(plan, layers=layers)
    c = compiled(model, ids, plan=plan, mode="static")
    with torch.no_grad():
        c(*ids)
    assert all(m.last_membership[0].labels == (0, 1, 1, 1) for m in chai_modules(c.graph_module))
    dec = ChaiDecoder(model, plan, mode="static")
    logits, _ = dec.prefill(ids[0])                          # static: any batch
    with torch.no_grad():
        torch.testing.assert_close(logits, c(*ids), **TOL)


def test_attention_inside_a_module_kept_whole_is_named_in_the_note():
    model = torch.nn.Sequential(PaddedMHA()).eval()
    x = torch.randn(2, 9, 16)
    c = tidal.compile(model, (x,), passes=[ClusteredAttention(clusters=2)], leaf_modules=["0"])
    (record,) = [r for r in c.records if r.name == "clustered_attention"]
    assert "no attention found" in record.notes[0] and "at 0.attn" in record.notes[0]


def test_no_attention_leaves_model_unchanged():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4)
    c = compiled(model, (x,), clusters=2)
    torch.testing.assert_close(c(x), model(x))
    (record,) = [r for r in c.records if r.name == "clustered_attention"]
    assert "looked for" in record.notes[0] and "scaled_dot_product_attention" in record.notes[0]
    assert record.added == () and record.nodes_before == record.nodes_after


@pytest.mark.parametrize("k", [0, 5, -1])
def test_cluster_count_outside_range_is_value_error(k):
    model = llama_small().eval()
    with pytest.raises(ValueError, match="outside 1..4"):
        compiled(model, model.example_inputs(1), clusters=k)
    with pytest.raises(ValueError, match="outside 1..4"):
        ClusteredHeads(0, 4, 2, k)
    with pytest.raises(ValueError, match="outside 1..4"):
        ChaiDecoder(model, counts=k)


def gqa_llama():
    """A tiny zoo Llama with 6 query heads on 2 KV heads (3 heads per KV head)."""
    cfg = dataclasses.replace(LlamaConfig(), vocab_size=64, hidden_size=48,
                              intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=6, num_key_value_heads=2,
                              max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg, example_seq_len=16).eval()


def causal_probs(scores):
    """Causal softmax of ``scores`` ``[B, H, T, T]``."""
    t = scores.shape[-1]
    return scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf).softmax(-1)


def nudged(probs, head):
    """``probs`` with one entry of ``head``'s first-token rows raised by one float32 ulp."""
    out = probs.clone()
    out[0, head, 4, 2] = torch.nextafter(out[0, head, 4, 2], torch.tensor(2.0))
    return out


def test_graph_and_decoder_break_a_representative_tie_alike():
    """Heads 0 and 1 are identical, so equally central in their cluster {0, 1, 2} (all on KV
    head 0); rounding noise of one ulp on either (as different kernels give) must not change
    the choice: the graph and the decoder both take the lowest head."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 6, 9, 9, generator=gen)
    scores[:, 1] = scores[:, 0]
    scores[:, 2] = scores[:, 0] + 0.3 * torch.randn(9, 9, generator=gen)
    scores[:, 3] = -10 * scores[:, 0]
    scores[:, 4:] = scores[:, 3] + torch.randn(2, 9, 9, generator=gen)
    probs = causal_probs(scores)
    graph_in = nudged(probs, 1)                       # the graph's probabilities: all keys
    decode_in = nudged(causal_probs(scores[..., :5, :5]), 0)   # the decoder's: 5 x 5
    for p, favoured in ((graph_in, 1), (decode_in, 0)):   # the noise really favours a head
        sim = cosine_similarity(head_features(p[0]))
        assert sim[favoured, 2] > sim[1 - favoured, 2] or sim[favoured, 2] < sim[1 - favoured, 2]
    (graph,) = ClusteredHeads(0, 6, 2, k=2).memberships(graph_in)
    decoder = ChaiDecoder(gqa_llama(), counts=2).first_token_membership(0, decode_in)
    assert graph.labels == (0, 0, 0, 1, 1, 1) and graph.representatives[0] == 0
    assert decoder == graph


def test_graph_and_decoder_memberships_agree_on_many_prompts():
    torch.manual_seed(0)
    model = llama_small().eval()
    prompts = [torch.randint(0, 256, (1, 14)) for _ in range(6)]   # the first: a 2-member tie
    c = compiled(model, (prompts[0],), clusters=[2, 3])
    dec = ChaiDecoder(model, counts=[2, 3])
    for ids in prompts:
        with torch.no_grad():
            c(ids)
        graph = [m.last_membership[0] for m in chai_modules(c.graph_module)]
        assert graph == dec.memberships(dec.prefill(ids)[1])


@pytest.mark.parametrize("passes", ["auto", "object"])
def test_uncalibrated_pass_leaves_the_graph_and_says_so(passes, tmp_path):
    model = llama_small().eval()
    x = model.example_inputs(2)
    c = tidal.compile(model, x, passes="auto" if passes == "auto" else [ClusteredAttention()])
    (record,) = [r for r in c.records if r.name == "clustered_attention"]
    (note,) = record.notes
    assert "not calibrated" in note and "calibrate()" in note and "clusters=" in note
    assert record.added == () and record.removed == ()
    assert record.nodes_before == record.nodes_after and record.plan is None
    assert not chai_modules(c.graph_module) and record.artifacts == {}
    assert c.plan.get("clustered_attention") is None
    c.dump(tmp_path)
    assert not [p.name for p in tmp_path.rglob("chai_*")]
    with torch.no_grad():
        torch.testing.assert_close(c(*x), model(*x))
