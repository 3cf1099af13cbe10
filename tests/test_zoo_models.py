"""Tests for the in-repo model zoo (examples/models)."""

import operator

import pytest
import torch
import torch.nn.functional as F
from torch.fx import GraphModule, symbolic_trace

from examples.models import (
    SMALL_MODELS,
    ZOO,
    BertForSequenceClassification,
    LlamaForCausalLM,
    bert_base,
    generate,
    inception_small,
    llama_decoder,
    llama_small,
    resnet50_small,
    smollm2_135m_config,
)
from greedy import assert_greedy

EXPECTED_NAMES = {
    "vgg16", "vgg16_small", "vgg19", "resnet50", "resnet50_small", "resnet101", "resnet152",
    "wide_resnet101_2", "wrn_small", "inception_v3", "inception_small",
    "bert_base", "bert_small", "llama_decoder", "llama_small",
    "dlrm", "dlrm_small", "deepfm", "deepfm_small",
}

# torchvision's published counts (inception_v3: 27,161,264 with aux minus 3,326,696 for AuxLogits).
FULL_SIZE_PARAMS = {
    "vgg16": 138_357_544,
    "vgg19": 143_667_240,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    "wide_resnet101_2": 126_886_696,
    "inception_v3": 23_834_568,
    "llama_decoder": 134_515_008,
}


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_small(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return ZOO[name]()


def test_registry_is_read_only_and_complete():
    assert set(ZOO) == EXPECTED_NAMES
    assert set(SMALL_MODELS) <= set(ZOO)
    assert all(name.endswith("_small") for name in SMALL_MODELS)
    with pytest.raises(TypeError):
        ZOO["other"] = resnet50_small  # type: ignore[index]


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_small_forward_backward_finite(name):
    model = build_small(name)
    inputs, targets = model.example_inputs(2), model.example_targets(2)
    loss = model.default_loss(model(*inputs), targets)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None, pname
        assert torch.isfinite(param.grad).all(), pname


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_small_symbolic_trace_matches_eager(name):
    model = build_small(name).eval()
    inputs = model.example_inputs(2)
    traced = symbolic_trace(model)
    assert isinstance(traced, GraphModule)
    with torch.no_grad():
        torch.testing.assert_close(traced(*inputs), model(*inputs))


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_example_data_is_deterministic(name):
    model = build_small(name)
    for first, second in zip(model.example_inputs(3), model.example_inputs(3)):
        assert torch.equal(first, second)
    assert torch.equal(model.example_targets(3), model.example_targets(3))


@pytest.mark.parametrize(
    ("name", "input_shape", "output_shape"),
    [
        ("vgg16_small", (2, 3, 32, 32), (2, 10)),
        ("resnet50_small", (2, 3, 32, 32), (2, 10)),
        ("wrn_small", (2, 3, 32, 32), (2, 10)),
        ("inception_small", (2, 3, 75, 75), (2, 10)),
        ("bert_small", (2, 16), (2, 2)),
        ("llama_small", (2, 16), (2, 16, 256)),
    ],
)
def test_small_shapes(name, input_shape, output_shape):
    model = build_small(name)
    (inputs,) = model.example_inputs(2)
    assert tuple(inputs.shape) == input_shape
    with torch.no_grad():
        outputs = model(inputs)
    assert tuple(outputs.shape) == output_shape
    targets = model.example_targets(2)
    assert targets.dtype == torch.int64
    assert tuple(targets.shape) == (output_shape[:2] if name == "llama_small" else output_shape[:1])


@pytest.mark.parametrize("name", sorted(FULL_SIZE_PARAMS))
def test_full_size_parameter_counts(name):
    with torch.device("meta"):
        model = ZOO[name]()
    assert num_params(model) == FULL_SIZE_PARAMS[name]


def test_full_size_example_inputs():
    with torch.device("meta"):
        bert, llama, inception = bert_base(), llama_decoder(), ZOO["inception_v3"]()
    assert tuple(bert.example_inputs(2)[0].shape) == (2, 128)
    assert tuple(llama.example_inputs(2)[0].shape) == (2, 128)
    assert tuple(llama.example_targets(2).shape) == (2, 128)
    assert tuple(inception.example_inputs(1)[0].shape) == (1, 3, 299, 299)


def test_bert_base_encoder_matches_hf_size_and_names():
    with torch.device("meta"):
        model = bert_base()
    assert isinstance(model, BertForSequenceClassification)
    assert num_params(model.bert) == 109_482_240  # bert-base-uncased BertModel
    names = set(model.state_dict())
    for key in (
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.LayerNorm.weight",
        "bert.encoder.layer.11.attention.self.query.weight",
        "bert.encoder.layer.0.attention.output.LayerNorm.bias",
        "bert.encoder.layer.0.intermediate.dense.weight",
        "bert.encoder.layer.0.output.dense.weight",
        "bert.pooler.dense.weight",
        "classifier.weight",
    ):
        assert key in names, key


def test_llama_state_dict_matches_hf_layout():
    with torch.device("meta"):
        model = LlamaForCausalLM(smollm2_135m_config())
    keys = set(model.state_dict())
    expected_layer = {
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
    }
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    expected |= {f"model.layers.{i}.{k}" for i in range(30) for k in expected_layer}
    assert keys == expected
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tuple(model.state_dict()["model.layers.0.self_attn.k_proj.weight"].shape) == (192, 576)


def test_resnet_and_inception_module_structure():
    resnet = resnet50_small()
    modules = dict(resnet.named_modules())
    assert {"conv1", "bn1", "relu", "maxpool", "avgpool", "fc", "layer1.0.downsample.0",
            "layer1.0.downsample.1", "layer1.1.conv3", "layer4.0.bn3"} <= set(modules)
    assert resnet.layer1[1].downsample is None

    traced = symbolic_trace(inception_small())
    cats = [n for n in traced.graph.nodes if n.op == "call_function" and n.target is torch.cat]
    # 3 InceptionA + 1 B + 4 C + 1 D + 2 E (each E has 2 nested + 1 outer cat).
    assert len(cats) == 3 + 1 + 4 + 1 + 2 * 3


@pytest.mark.parametrize("name", ["bert_small", "llama_small"])
def test_attention_is_explicit_matmul(name):
    graph = symbolic_trace(build_small(name)).graph
    targets = {n.target for n in graph.nodes if n.op in ("call_function", "call_method")}
    assert F.scaled_dot_product_attention not in targets
    matmuls = [n for n in graph.nodes if n.op == "call_function" and n.target is operator.matmul]
    assert len(matmuls) == 2 * 2  # (q @ k^T, probs @ v) per layer, 2 layers
    assert "softmax" in targets


def test_llama_trace_with_concrete_none_cache():
    model = build_small("llama_small").eval()
    (input_ids,) = model.example_inputs(2)
    traced = symbolic_trace(model, concrete_args={"past_key_values": None})
    with torch.no_grad():
        torch.testing.assert_close(traced(input_ids), model(input_ids))


def test_llama_plain_trace_rejects_cache():
    model = build_small("llama_small").eval()
    traced = symbolic_trace(model)
    (input_ids,) = model.example_inputs(1)
    with pytest.raises(ValueError):
        traced(input_ids, model.empty_cache(1))


def test_llama_kv_cache_matches_full_forward():
    model = build_small("llama_small").eval()
    (input_ids,) = model.example_inputs(2)
    prefix = 5
    with torch.no_grad():
        full = model(input_ids)
        logits, cache = model(input_ids[:, :prefix], model.empty_cache(2))
        steps = [logits]
        for t in range(prefix, input_ids.shape[1]):
            logits, cache = model(input_ids[:, t : t + 1], cache)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    config = model.config
    assert len(cache) == config.num_hidden_layers
    for key, value in cache:
        expected = (2, config.num_key_value_heads, input_ids.shape[1], config.head_dim)
        assert tuple(key.shape) == expected and tuple(value.shape) == expected


def test_llama_greedy_generate_matches_uncached_argmax():
    model = build_small("llama_small").eval()
    prompt = model.example_inputs(2)[0][:, :4]
    out = generate(model, prompt, max_new_tokens=6)
    assert tuple(out.shape) == (2, 10)
    assert torch.equal(out[:, :4], prompt)
    assert_greedy(out, 4, model)       # the uncached forward's argmax, up to rounding


def test_llama_loss_uses_next_token_targets():
    model = llama_small()
    (inputs,) = model.example_inputs(2)
    targets = model.example_targets(2)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_llama_tied_checkpoint_without_lm_head_loads_strictly():
    from dataclasses import replace

    from examples.models.llama import llama_small_config

    config = replace(llama_small_config(), tie_word_embeddings=True)
    source, target = LlamaForCausalLM(config), LlamaForCausalLM(config)
    checkpoint = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    target.load_state_dict(checkpoint)  # strict
    assert torch.equal(target.lm_head.weight, source.model.embed_tokens.weight)
    assert target.lm_head.weight is target.model.embed_tokens.weight
