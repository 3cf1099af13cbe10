"""clustered_attention on eager attention and nn.MultiheadAttention computes only representative
heads' scores after the first five rows: the pass takes an eager ``softmax(mask(scale(Q @
Kᵀ))) @ V`` out of the graph whole (Hugging Face Llama / GPT-2 / BERT / OPT / T5 / ViT with
eager attention, the zoo's Llama and BERT), and ``nn.MultiheadAttention`` (standalone, and inside
``nn.TransformerEncoder``) passes its Q, K, V and masks on, so that the graph calls
``tidal::clustered_attention``. With one head per cluster the output is the model's; with fewer
it is the reference that computes every head's scores and shares the probabilities
(``representatives_only`` off), at the same memberships. What cannot be mapped exactly falls
back to sharing after the softmax, and the pass or ``last_route`` says why."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tidal
from tidal.passes.clustered_attention import (ClusteredAttention, ClusteredEagerAttention,
                                              ClusteredHeads, chai_modules)
from examples.models import bert_small, llama_small

from test_attention_match import TorchEncoder, causal_mask
from third_party.models import BUILDERS, logits_of

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-5)


class OpCalls(TorchDispatchMode):
    """Counts the calls of ``tidal::clustered_attention`` under it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.tidal.clustered_attention.default
        return func(*args, **(kwargs or {}))


def hf_opt():
    """OPT (eager): ``bmm`` on ``[B*H, T, D]``, the scaling folded into Q; left padding."""
    cfg = transformers.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=32,
                                 word_embed_proj_dim=32, attn_implementation="eager")
    torch.manual_seed(0)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0
    return transformers.OPTForCausalLM(cfg).eval(), {"input_ids": torch.randint(0, 64, (2, 9)),
                                                     "attention_mask": mask}, 4


class MaskedMHA(torch.nn.Module):
    """A batch-first ``nn.MultiheadAttention`` with boolean masks (True hides): causal, and
    key padding ``pad``."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x, pad):
        return self.attn(x, x, x, key_padding_mask=pad, attn_mask=causal_mask(x.shape[1]),
                         need_weights=False)[0]


def padded(x):
    """``x`` and a key padding mask hiding the last 2 positions of sample 1."""
    pad = torch.zeros(*x.shape[:2], dtype=torch.bool)
    pad[1, -2:] = True
    return x, pad


def case(name):
    """``(model, inputs (a tuple, or a dict of keyword inputs), heads per layer)``."""
    if name == "zoo_llama":
        model = llama_small().eval()
        return model, model.example_inputs(2), 4
    if name == "zoo_bert":
        model = bert_small().eval()
        return model, model.example_inputs(2), 4
    if name == "hf_opt":
        return hf_opt()
    if name in ("nn_encoder_masked", "nn_mha_masked"):   # masks passed on to the op
        torch.manual_seed(0)
        model = TorchEncoder(causal=True) if name == "nn_encoder_masked" else MaskedMHA()
        return model.eval(), padded(torch.randn(2, 9, 16)), 4
    c = BUILDERS[name]()
    return c.model, c.inputs, c.heads[0]


def compiled(model, inputs, k):
    return tidal.compile(model, inputs, passes=[ClusteredAttention(clusters=k)])


def logits(f, inputs):
    out = f(**inputs) if isinstance(inputs, dict) else f(*inputs)
    return logits_of(out[0] if isinstance(out, tuple) else out)


def run(c, inputs):
    """The compiled graph's logits and how many times it called the op."""
    with torch.no_grad(), OpCalls() as calls:
        out = logits(c, inputs)
    return out, calls.count


def original(model, inputs):
    with torch.no_grad():
        return logits(model, inputs)


NAMES = ["llama", "gpt2", "bert", "hf_opt", "t5", "vit", "zoo_llama", "zoo_bert", "nn_transformer",
         "nn_mha", "nn_encoder_masked", "nn_mha_masked"]


@pytest.mark.parametrize("name", NAMES)
def test_every_layer_calls_the_op_and_one_head_per_cluster_is_the_model(name):
    model, inputs, heads = case(name)
    c = compiled(model, inputs, heads)
    (record,) = [r for r in c.records if r.name == "clustered_attention"]
    assert len(record.notes) == 1, record.notes       # no layer left sharing after the softmax
    mods = chai_modules(c.graph_module)
    out, calls = run(c, inputs)
    assert calls == len(mods) and all(m.last_route == "representatives" for m in mods)
    torch.testing.assert_close(out, original(model, inputs), **TOL)
    if not name.startswith("nn_"):  # eager attention, taken out of the graph whole
        assert all(type(m) is ClusteredEagerAttention for m in mods)
        assert not [n for n in c.graph_module.graph.nodes if "softmax" in str(n.target)]


@pytest.mark.parametrize("name", NAMES)
def test_fewer_clusters_equal_every_head_computed_then_shared(name):
    model, inputs, heads = case(name)
    c = compiled(model, inputs, heads // 2)
    mods = chai_modules(c.graph_module)
    fast, calls = run(c, inputs)
    memberships = [m.last_membership for m in mods]
    assert calls == len(mods)
    assert all(len(set(mem.labels)) == heads // 2 for ms in memberships for mem in ms)
    for m in mods:
        m.representatives_only = False
    reference, calls = run(c, inputs)
    assert calls == 0 and all(m.last_route.startswith("all heads") for m in mods)
    assert [m.last_membership for m in mods] == memberships
    torch.testing.assert_close(fast, reference, **TOL)


class Explicit(torch.nn.Module):
    """Attention on ``x`` ``[B, T, 16]`` (4 heads of 4), written out: the causal mask filled
    with ``fill``, optionally soft-capped scores (``tanh``, as Gemma 2 does), probabilities
    through ``self.drop`` (an ``nn.Dropout`` module reads its mode when it runs) and scaled per
    head by ``head_scale`` (transformers 4's ``head_mask``)."""

    def __init__(self, fill=float("-inf"), cap=None, head_scale=None, dropout=0.0):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.drop = torch.nn.Dropout(dropout)
        self.fill, self.cap, self.head_scale = fill, cap, head_scale

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, 4)).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(4)
        if self.cap is not None:
            scores = torch.tanh(scores / self.cap) * self.cap
        scores = scores.masked_fill(causal_mask(x.shape[1]), self.fill)
        probs = self.drop(scores.softmax(-1))
        if self.head_scale is not None:
            probs = probs * torch.tensor(self.head_scale).view(1, -1, 1, 1)
        return (probs @ v).transpose(1, 2).flatten(2)


def test_a_per_head_scale_falls_back_to_sharing_after_the_softmax_and_the_pass_says_so():
    torch.manual_seed(0)
    model, x = Explicit(head_scale=[1.0, 0.5, 0.0, 1.0]).eval(), (torch.randn(2, 9, 16),)
    c = compiled(model, x, 4)
    (record,) = [r for r in c.records if r.name == "clustered_attention"]
    assert "every head's scores computed" in record.notes[-1]
    assert "layer 0" in record.notes[-1] and "between the softmax and V" in record.notes[-1]
    assert [type(m) for m in chai_modules(c.graph_module)] == [ClusteredHeads]
    out, calls = run(c, x)
    assert calls == 0
    torch.testing.assert_close(out, original(model, x), **TOL)


@pytest.mark.parametrize("fill,route", [
    (float("-inf"), "representatives"),
    (torch.finfo(torch.float32).min, "representatives"),     # x + finfo.min == finfo.min
    (-1e4, "all heads: fill value -10000 in torch.float32 is not a mask"),
])
def test_a_boolean_mask_is_passed_on_only_where_its_fill_hides_the_score(fill, route):
    torch.manual_seed(0)
    model, x = Explicit(fill).eval(), (torch.randn(2, 9, 16),)
    c = compiled(model, x, 4)
    (m,) = chai_modules(c.graph_module)
    out, calls = run(c, x)
    assert m.last_route.startswith(route) and calls == (route == "representatives")
    torch.testing.assert_close(out, original(model, x), **TOL)


def test_soft_capped_scores_fall_back_and_the_pass_says_so():
    torch.manual_seed(0)
    model, x = Explicit(cap=5.0).eval(), (torch.randn(2, 9, 16),)
    c = compiled(model, x, 4)
    (record,) = [r for r in c.records if r.name == "clustered_attention"]
    assert "layer 0" in record.notes[-1] and "tanh" in record.notes[-1]
    out, calls = run(c, x)
    assert calls == 0
    torch.testing.assert_close(out, original(model, x), **TOL)


def test_dropout_in_training_and_gradients_compute_every_head():
    # a dropout module (read in its mode when it runs; transformers 5 decides its functional
    # attention dropout at capture, see README)
    torch.manual_seed(0)
    model, x = Explicit(dropout=0.1).eval(), (torch.randn(2, 9, 16),)
    c = compiled(model, x, 2)
    (m,) = chai_modules(c.graph_module)
    c.graph_module.train()
    _, calls = run(c, x)
    assert calls == 0 and m.last_route == "all heads: dropout in training"
    c.graph_module.eval()
    logits(c, x).sum().backward()      # the op has no backward
    assert m.last_route.startswith("all heads: gradients")
    assert model.qkv.weight.grad is not None
    _, calls = run(c, x)
    assert calls == 1 and m.last_route == "representatives"


class MHAWithWeights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x):
        out, weights = self.attn(x, x, x)
        return out + weights.sum(-1, keepdim=True)


def test_mha_whose_weights_are_read_computes_every_head_and_the_pass_says_so():
    torch.manual_seed(0)
    model, x = MHAWithWeights().eval(), (torch.randn(2, 9, 16),)
    c = compiled(model, x, 4)
    (record,) = [r for r in c.records if r.name == "clustered_attention"]
    assert "layer 0 (attn): its attention weights are read" in record.notes[-1]
    out, calls = run(c, x)
    (m,) = chai_modules(c.graph_module)
    assert calls == 0 and "need_weights" in m.last_route
    torch.testing.assert_close(out, original(model, x), **TOL)
