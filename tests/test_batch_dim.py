"""Batch-dimension analysis (``tidal.ir.batch_dim``) on models nobody here wrote: Hugging Face
classes from small configs with random weights and plain ``torch.nn`` models."""
import pytest
import torch
import torch.fx as fx

import tidal
from tidal.ir import batch_dim, meta
from tidal.ir.batch_dim import BATCH, FOLDED, REDUCED, REPLICATED, UNKNOWN, BatchDim

transformers = pytest.importorskip("transformers")

B = 2


def _ids(vocab=100, t=8):
    return torch.randint(0, vocab, (B, t))


def _mask(t=8):
    mask = torch.ones(B, t, dtype=torch.long)
    mask[1, -2:] = 0
    return mask


def _lm_inputs(vocab):
    return {"input_ids": _ids(vocab), "attention_mask": _mask()}


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg), _lm_inputs(100)


def _gqa_lm(config_cls, model_cls):
    """A one-layer causal LM with rotary positions and grouped-query attention (4 heads, 2 KV)."""
    cfg = config_cls(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return model_cls(cfg), _lm_inputs(128)


def llama():
    return _gqa_lm(transformers.LlamaConfig, transformers.LlamaForCausalLM)


def qwen2():
    return _gqa_lm(transformers.Qwen2Config, transformers.Qwen2ForCausalLM)


def mistral():
    return _gqa_lm(transformers.MistralConfig, transformers.MistralForCausalLM)


def bert():
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64)
    return transformers.BertModel(cfg), _lm_inputs(100)


def t5():
    cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                num_heads=4)
    inputs = _lm_inputs(100)
    inputs["decoder_input_ids"] = _ids(100, 5)
    return transformers.T5ForConditionalGeneration(cfg), inputs


def _pixels(size=32):
    return {"pixel_values": torch.randn(B, 3, size, size)}


def vit():
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64, num_labels=3)
    return transformers.ViTForImageClassification(cfg), _pixels()


def swin():
    cfg = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
                                  num_heads=[2, 4], window_size=4)
    return transformers.SwinModel(cfg), _pixels()


def convnext():
    cfg = transformers.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                                      image_size=32)
    return transformers.ConvNextModel(cfg), _pixels()


class LayerScaleBlock(torch.nn.Module):
    """ConvNeXt's block as its paper's code writes the layer scale: ``gamma.view(C, 1, 1)``."""

    def __init__(self, c=16):
        super().__init__()
        self.dwconv = torch.nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = torch.nn.GroupNorm(1, c)
        self.gamma = torch.nn.Parameter(torch.full((c,), 1e-6))

    def forward(self, x):
        return x + self.gamma.view(16, 1, 1) * self.norm(self.dwconv(x))


def layer_scale():
    return LayerScaleBlock(), (torch.randn(B, 16, 8, 8),)


class EncoderClassifier(torch.nn.Module):
    """``nn.TransformerEncoder`` (its forward is not traceable, so fx keeps it whole)."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(32, 3)

    def forward(self, x, padding_mask):
        return self.head(self.encoder(x, src_key_padding_mask=padding_mask)[:, 0])


def transformer_encoder():
    return EncoderClassifier(), (torch.randn(B, 6, 32), _mask(6) == 0)


class LSTMClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.lstm = torch.nn.LSTM(16, 24, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(24, 3)

    def forward(self, ids):
        out, (h, _) = self.lstm(self.emb(ids))
        return self.head(out[:, -1]) + self.head(h[-1])


def lstm():
    return LSTMClassifier(), (_ids(50),)


class MHAModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.pos = torch.nn.Embedding(16, 32)
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, ids):
        t = ids.size(1)
        pos = torch.arange(t)
        causal = pos[None, :] > pos[:, None]
        x = self.emb(ids) + self.pos(pos)
        y, weights = self.attn(x, x, x, attn_mask=causal)
        return self.head(y.mean(1)), weights


def mha():
    return MHAModel(), (_ids(50),)


MODELS = {"gpt2": gpt2, "llama": llama, "qwen2": qwen2, "mistral": mistral, "bert": bert,
          "t5": t5, "vit": vit, "swin": swin, "convnext": convnext, "layer_scale": layer_scale,
          "transformer_encoder": transformer_encoder, "lstm": lstm, "mha": mha}


def build(name):
    """(traced graph, facts) of one of ``MODELS``, analysed at batch ``B``."""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    gm = tidal.trace(model.eval(), inputs)
    return gm, batch_dim.analyze(gm, inputs, B)


@pytest.fixture(scope="module")
def zoo():
    """``zoo(name)``: the analysed graph of one of ``MODELS``, built once per module."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = build(name)
        return built[name]

    return get


def _nodes(gm):
    return {n.name: n for n in gm.graph.nodes}


def _output_nodes(gm):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [a for a in out.all_input_nodes]


def _kind(fact):
    return batch_dim.node_kind(fact)


@pytest.mark.parametrize("name", list(MODELS))
def test_outputs_are_batch_dim_0_and_nothing_is_unknown(zoo, name):
    gm, facts = zoo(name)
    outputs = _output_nodes(gm)
    assert outputs
    for node in outputs:
        fact = facts[node.name]
        assert isinstance(fact, BatchDim) and (fact.kind, fact.dim) == (BATCH, 0), (node, fact)
        assert batch_dim.is_batched(node) and not batch_dim.replicated(node)
    assert batch_dim.unknown_nodes(gm) == []
    for n in gm.graph.nodes:
        if n.op != "output":
            assert meta.get_batch_dim(n) == facts[n.name]
        if n.op == "get_attr":
            assert batch_dim.replicated(n)


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "mistral", "t5", "mha"])
def test_position_ids_and_rotary_tables_are_replicated(zoo, name):
    gm, facts = zoo(name)
    aranges = [n for n in gm.graph.nodes if batch_dim.op_name(n) == "arange"]
    assert aranges
    for n in aranges:  # positions; an arange over the samples (transformers 5's masks) batched
        over_samples = any(isinstance(a, fx.Node) and facts[a.name].kind == batch_dim.SIZE
                           for a in n.args)
        assert facts[n.name].kind == (BATCH if over_samples else REPLICATED), n
    for n in gm.graph.nodes:  # rotary embeddings: cos/sin of position x inv_freq
        if n.op != "call_module" and batch_dim.op_name(n) in ("cos", "sin"):
            assert facts[n.name].kind == REPLICATED, n


def _descendants(gm, root):
    seen, out = {root}, []
    for n in gm.graph.nodes:
        if any(a.name in seen for a in n.all_input_nodes):
            seen.add(n.name)
            out.append(n)
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "mistral", "bert", "t5"])
def test_attention_mask_derived_values_are_batched(zoo, name):
    gm, facts = zoo(name)
    derived = _descendants(gm, "attention_mask")
    kinds = {_kind(facts[n.name]) for n in derived if n.op != "output"}
    assert BATCH in kinds and not kinds & {REDUCED, UNKNOWN}
    masks = [n.kwargs["attn_mask"] for n in derived
             if n.target is torch.nn.functional.scaled_dot_product_attention]
    for mask in masks:  # the mask each attention reads holds one row per sample
        assert (facts[mask.name].kind, facts[mask.name].dim) == (BATCH, 0)


def test_llama_grouped_query_heads_keep_the_batch(zoo):
    gm, facts = zoo("llama")  # repeat_kv: expand(B, kv, n_rep, T, d).reshape(B, kv*n_rep, T, d)
    expands = [n for n in gm.graph.nodes if batch_dim.op_name(n) == "expand"
               and len(n.args[1:] if n.op == "call_method" else n.args[1]) == 5]
    assert expands
    for n in expands:
        assert (facts[n.name].kind, facts[n.name].dim) == (BATCH, 0)
        for user in n.users:
            assert (facts[user.name].kind, facts[user.name].dim) == (BATCH, 0)


def test_bert_buffered_ids(zoo):
    gm, facts = zoo("bert")
    nodes = _nodes(gm)
    # position_ids[:, :T], a slice of a [1, L] buffer, and its embeddings: replicated
    positions = nodes["embeddings_position_ids"]
    (slice_,) = positions.users
    assert facts[slice_.name].kind == REPLICATED
    assert all(facts[u.name].kind == REPLICATED for u in slice_.users)
    # the token_type_ids buffer, read at the positions (transformers 5: expand, gather), then
    # .expand(B, T): a replicated row copied for each sample
    chain = [nodes["embeddings_token_type_ids"]]
    while facts[chain[-1].name].kind == REPLICATED:
        (user,) = chain[-1].users
        chain.append(user)
    last = chain[-1]
    assert len(chain) > 2 and "expand" in str(last.target), chain
    assert (facts[last.name].kind, facts[last.name].dim) == (BATCH, 0)


def test_swin_window_partition_folds_and_reverse_unfolds(zoo):
    gm, facts = zoo("swin")
    folded = {n.name: facts[n.name] for n in gm.graph.nodes
              if isinstance(facts.get(n.name), BatchDim) and facts[n.name].kind == FOLDED}
    # 32x32 image, patch 4 -> 8x8 patches, window 4 -> 4 windows per image in stage 1
    assert folded and {f.factor for f in folded.values()} == {4}
    assert all(f.dim == 0 and f.rows(1, 2) == slice(4, 8) for f in folded.values())
    nodes = _nodes(gm)
    views = [n for n in gm.graph.nodes if n.op != "call_module" and
             batch_dim.op_name(n) == "view"]
    partitions = [n for n in views if n.name in folded and facts[n.args[0].name].kind == BATCH]
    reverses = [n for n in views if n.name not in folded and n.args[0].name in folded]
    assert partitions and reverses
    for n in reverses:  # window_reverse's view(-1, h, w, ws, ws, C): the batch again
        assert (facts[n.name].kind, facts[n.name].dim) == (BATCH, 0)
    rolls = [n for n in gm.graph.nodes if n.op != "call_module" and
             batch_dim.op_name(n) == "roll"]
    assert rolls and all(facts[n.name].kind == BATCH for n in rolls)
    assert nodes["pixel_values"] and batch_dim.summary(gm)[FOLDED] == len(folded)


def test_convnext_layer_scale_is_replicated(zoo):
    gm, facts = zoo("convnext")
    scales = [n for n in gm.graph.nodes if n.op == "get_attr" and "layer_scale" in n.target]
    assert scales
    for n in scales:
        assert facts[n.name].kind == REPLICATED
        assert all(facts[u.name].kind == BATCH for u in n.users)
    gm, facts = zoo("layer_scale")  # gamma.view(16, 1, 1): a parameter view
    view = next(n for n in gm.graph.nodes if n.target == "view")
    assert facts[view.name].kind == REPLICATED and batch_dim.replicated(view)
    assert (facts["mul"].kind, facts["mul"].dim) == (BATCH, 0)


def test_lstm_tuple_outputs_per_element(zoo):
    gm, facts = zoo("lstm")
    lstm = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "lstm")
    out, (h, c) = facts[lstm.name]
    assert (out.kind, out.dim) == (BATCH, 0)  # [B, T, H] (batch_first)
    assert (h.kind, h.dim) == (c.kind, c.dim) == (BATCH, 1)  # [layers, B, H]


def test_mha_weights_and_causal_mask(zoo):
    gm, facts = zoo("mha")
    assert facts["gt"].kind == REPLICATED  # the causal mask from arange
    attn = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "attn")
    assert [(f.kind, f.dim) for f in facts[attn.name]] == [(BATCH, 0), (BATCH, 0)]


class Tricky(torch.nn.Module):
    """Patterns the analysis must refuse or classify: fixed-shape views, samples interleaved by
    a reshape, cat and softmax along the samples, reductions over them, in-place writes."""

    def forward(self, x):  # x: [B, 16, 16, 16]
        fixed = x.view(32, 4, 4, 16)
        inner = x.transpose(0, 1).reshape(16, -1)  # [16, B*16*16]: fine, samples after 16
        interleaved = x.permute(1, 0, 2, 3).reshape(-1, 16)  # [16*B*16, 16]: samples inside
        doubled = torch.cat([x, x], 0)
        mixed = torch.softmax(x, 0)
        total = x.sum(0)
        centred = x - x.mean(0)
        table = x.new_zeros(16)
        table.add_(x.mean((0, 2, 3)))
        after = table * 2
        return fixed, inner, interleaved, doubled, mixed, total, centred, after, fixed + 1


def test_unknowns_name_the_node_and_why():
    gm = tidal.trace(Tricky(), (torch.randn(B, 16, 16, 16),))
    facts = batch_dim.analyze(gm, (torch.randn(B, 16, 16, 16),), B)
    reasons = dict((n.name, why) for n, why in batch_dim.unknown_nodes(gm))
    assert reasons["view"].startswith("view = view(32, 4, 4, 16) of a [2, 16, 16, 16] value "
                                      "fails at batch 4")
    assert "which output dim holds the 2 samples" in reasons["view"]
    assert (facts["reshape"].kind, facts["reshape"].dim, facts["reshape"].factor) == \
        (FOLDED, 1, 256)
    assert "interleaved" in reasons["reshape_1"] and reasons["reshape_1"].startswith("reshape_1")
    assert "no input has" in reasons["cat"]
    assert "mixes the samples" in reasons["softmax"]
    assert facts["sum_1"].kind == REDUCED
    assert "computed from all samples" in reasons["sub"]
    assert "written in place by add_ = add_(mean_1)" in reasons["new_zeros"]
    assert reasons["mul"] == "mul: follows unknown new_zeros"
    assert reasons["add"].startswith("add: follows unknown view")
    roots = {n.name for n, _ in batch_dim.unknown_nodes(gm, roots_only=True)}
    assert "mul" not in roots and "add" not in roots and "view" in roots


def test_batch_dim_rows_and_validation():
    fact = BatchDim(FOLDED, 0, 4)
    assert fact.rows(2, 3) == slice(8, 12) and fact.splits
    with pytest.raises(ValueError):
        BatchDim("sideways")
    with pytest.raises(ValueError):
        BatchDim(REPLICATED).rows(0, 1)


def test_node_kind_ranks_unknown_then_batch_then_the_rest():
    from tidal.ir.batch_dim import BatchDim, node_kind

    assert node_kind((BatchDim("batch", 0), BatchDim("replicated"))) == "batch"
    assert node_kind((BatchDim("batch", 0), BatchDim("size"))) == "batch"
    assert node_kind((BatchDim("folded", 0, 4), BatchDim("reduced"))) == "folded"
    assert node_kind((BatchDim("batch", 0), BatchDim("unknown", reason="x"))) == "unknown"
    assert node_kind(BatchDim("replicated")) == "replicated"


def test_analysis_leaves_batchnorm_statistics_alone():
    # float64 BatchNorm in training mode: the fake runs update num_batches_tracked for real
    # unless the analysis restores the buffers
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).double().train()
    before = {n: b.clone() for n, b in model.named_buffers()}
    gm = fx.symbolic_trace(model)
    batch_dim.analyze(gm, (torch.randn(8, 4, dtype=torch.float64),), 8)
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n


class _SortsAndRanks(torch.nn.Module):
    """Sorts along the features (a tuple-valued op, as a mixture of experts' top-k routing
    does), then along the samples."""

    def forward(self, x):
        values, order = torch.sort(x, dim=-1)
        by_sample, _ = torch.sort(values, dim=0)
        return values + order, by_sample


def test_tuple_valued_ops_along_a_feature_dim_keep_the_batch():
    x = torch.randn(B, 5)
    gm = tidal.trace(_SortsAndRanks(), (x,))
    facts = batch_dim.analyze(gm, (x,), B)
    values, order = facts["sort"]   # one fact per element of the tuple
    assert (values.kind, values.dim, order.kind) == (BATCH, 0, BATCH)
    assert facts["add"].kind == BATCH
    assert all(f.kind == UNKNOWN and "mixes the samples" in f.reason for f in facts["sort_1"])
