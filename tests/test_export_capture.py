"""Capture through torch.export (non-strict): Hugging Face models from small configs, under
any transformers version. The graph equals the model, reads the model's own parameters, keeps
each torch.nn leaf module as one call_module node named by its qualified path, and the
attention matcher, cost model and batch-dimension analysis run on it. Models that exist only
in transformers 5 (Qwen3, Gemma3, OLMo2, Qwen3-MoE) compile and equal eager."""
import pytest
import torch

import tidal
from tidal.ir import batch_dim, cost, layer_graph
from tidal.ir.export_capture import export_trace, is_torch_leaf
from tidal.ir.inputs import bind_inputs
from tidal.passes.attention_match import eager_parts, find_attention

transformers = pytest.importorskip("transformers")
from third_party.models import BATCH, BUILDERS, logits_of  # noqa: E402

NAMES = ("gpt2", "llama", "bert", "vit", "t5")
LEAVES = {   # some of the leaf modules each graph must call by their qualified names
    "gpt2": {"transformer.wte", "transformer.h.0.ln_1", "transformer.drop",
             "transformer.h.1.ln_2", "lm_head"},
    "llama": {"model.embed_tokens", "model.layers.0.self_attn.q_proj",
              "model.layers.1.mlp.down_proj", "lm_head"},
    "bert": {"bert.embeddings.word_embeddings", "bert.encoder.layer.0.attention.self.query",
             "bert.encoder.layer.1.output.LayerNorm", "classifier"},
    "vit": {"vit.embeddings.patch_embeddings.projection", "vit.layernorm", "classifier"},
    "t5": {"decoder.block.0.layer.1.EncDecAttention.q", "lm_head"},
}


@pytest.fixture(scope="module")
def captured():
    """name -> (case, graph module), each model exported once."""
    out = {}
    for name in NAMES:
        case = BUILDERS[name]()
        out[name] = (case, export_trace(case.model, case.inputs))
    return out


def _outputs(value):
    return {k: v for k, v in value.items()} if hasattr(value, "keys") else {"": value}


@pytest.mark.parametrize("name", NAMES)
def test_the_graph_equals_the_model(captured, name):
    case, gm = captured[name]
    with torch.no_grad():
        want, got = _outputs(case.call()), _outputs(gm(**case.inputs))
        assert set(got) <= set(want) and "logits" in got
        for key, value in got.items():
            torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6, msg=key)
        # the batch is symbolic: one more row runs the same graph
        more = {k: torch.cat([v, v[:1]]) for k, v in case.inputs.items()}
        torch.testing.assert_close(logits_of(gm(**more)), logits_of(case.model(**more)),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_parameters_are_the_models_own_and_leaves_are_call_modules(captured, name):
    case, gm = captured[name]
    model = case.model
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            if isinstance(obj, torch.Tensor):
                own = dict(model.named_parameters(remove_duplicate=False))
                own.update(model.named_buffers(remove_duplicate=False))
                assert own[n.target] is obj, n.target
        elif n.op == "call_module":
            assert gm.get_submodule(n.target) is model.get_submodule(n.target)
            assert is_torch_leaf(model.get_submodule(n.target)), n.target
    calls = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert LEAVES[name] <= calls, LEAVES[name] - calls
    if name == "t5":  # a module under several names (transformers 4's shared embedding) is
        embed = model.encoder.embed_tokens  # called by its first one, as fx names it
        first = next(p for p, m in model.named_modules() if m is embed)
        assert first in calls
    # nothing of a leaf module is left as aten ops
    inside = [n.name for n in gm.graph.nodes if n.op == "call_function" and
              any(path in calls for path, _ in (n.meta.get("nn_module_stack") or {}).values())]
    assert not inside, inside
    assert {p for p in gm.parameters()} <= {p for p in model.parameters()}


@pytest.mark.parametrize("name,heads,kv", [("gpt2", 4, 4), ("llama", 4, 2)])
def test_the_attention_matcher_finds_every_layer(captured, name, heads, kv):
    case, gm = captured[name]
    cost.annotate(gm, bind_inputs(gm, case.inputs))
    found = find_attention(gm, case.model)
    scope = "transformer.h.{}.attn" if name == "gpt2" else "model.layers.{}.self_attn"
    assert [m.scope for m in found] == [scope.format(i) for i in range(2)]
    assert {(m.kind, m.num_heads, m.num_kv_heads, m.head_dim) for m in found} == \
        {("eager", heads, kv, 8)}
    for m in found:
        parts = eager_parts(gm, m)       # taken apart for the clustered-attention rewrite
        assert parts.softmax.kind == "softmax"


@pytest.mark.parametrize("name", NAMES)
def test_cost_model_batch_dims_and_layer_graph_run(captured, name):
    case, gm = captured[name]
    cost.annotate(gm, bind_inputs(gm, case.inputs))
    totals = cost.total_cost(gm, BATCH)
    assert totals["fwd_flops"] > 0 and totals["param_bytes"] > 0
    facts = batch_dim.analyze(gm, case.inputs, BATCH)
    unknown = {k: f.reason for k, f in facts.items()
               if isinstance(f, batch_dim.BatchDim) and f.kind == batch_dim.UNKNOWN}
    assert not unknown, unknown
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]["logits"]
    assert facts[out.name] == batch_dim.BatchDim(batch_dim.BATCH, 0)
    assert layer_graph.build(gm).number_of_nodes() > 10


def test_compile_runs_a_pass_on_an_exported_model_and_dumps_it(tmp_path):
    case = BUILDERS["gpt2"]()
    c = tidal.compile(case.model, case.inputs, passes=["layer_groups"])
    assert "trace: traced with torch.export (non-strict)" in c.report()
    with torch.no_grad():
        torch.testing.assert_close(logits_of(case.call(c)), logits_of(case.call()))
    index = c.dump(tmp_path)
    assert index.exists() and "layer_groups" in index.read_text()


# --- models only transformers 5 has ----------------------------------------------------------

V5 = int(transformers.__version__.split(".")[0]) >= 5
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _v5_model(name):
    t = transformers
    if name == "qwen3":
        return t.Qwen3ForCausalLM(t.Qwen3Config(**SMALL, head_dim=8))
    if name == "gemma3":
        return t.Gemma3ForCausalLM(t.Gemma3TextConfig(**SMALL, head_dim=8, sliding_window=4))
    if name == "olmo2":
        return t.Olmo2ForCausalLM(t.Olmo2Config(**SMALL))
    return t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(
        **SMALL, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1))


@pytest.mark.skipif(not V5, reason="these model classes exist from transformers 5")
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "olmo2", "qwen3_moe"])
def test_transformers_5_models_compile_and_equal_eager(name):
    torch.manual_seed(0)
    model = _v5_model(name).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    c = tidal.compile(model, {"input_ids": ids})
    assert c.records[0].notes[0] == "traced with torch.export (non-strict)"
    with torch.no_grad():
        torch.testing.assert_close(c(ids)["logits"], model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


class _Counter(torch.nn.Module):
    """A forward that updates a buffer in place, beside BatchNorm's statistics."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(1)
        return self.bn(self.lin(x)) * 2


@pytest.mark.parametrize("functional", [False, True])
def test_buffer_updates_reach_the_models_buffers(monkeypatch, functional):
    # functional: an export that lifts buffer mutations as extra outputs (a functionalised
    # graph, as run_decompositions makes) is written back into the model's buffers
    if functional:
        export = torch.export.export
        monkeypatch.setattr(torch.export, "export",
                            lambda *a, **k: export(*a, **k).run_decompositions({}))
    model, ref = _Counter().train(), _Counter().train()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    gm = export_trace(model, (x,))
    assert float(model.count) == 0
    for _ in range(2):
        torch.testing.assert_close(gm(x), ref(x))
    assert float(model.count) == 2 and int(model.bn.num_batches_tracked) == 2
    torch.testing.assert_close(model.bn.running_var, ref.bn.running_var)
