"""CHAI's generation on the Hugging Face Cache API of the installed transformers (5.x, and 4.47
where that is installed): ``ClusteredKCache`` handed to ``generate`` directly and
``generation_model`` built from a plan made by hand (no ``tidal.compile``), tiny configs.

References: with one head per cluster, Hugging Face's own ``generate`` (tokens, logits within
1e-4); with fewer, the same clustered attention computed over the whole generated sequence
without a cache (``tidal::clustered_attention`` over every row, not the pruned decode step),
single-sequence runs for batches, and tidal's side decoder ``ChaiDecoder`` for Llama."""
from dataclasses import replace

import pytest
import torch

from tidal.ir.plans.chai import ChaiPlan, LayerChoice
from tidal.runtime.chai import hf_compat
from tidal.runtime.chai.cache import ClusteredKCache, k_bytes
from tidal.runtime.chai.decode import ChaiDecoder
from tidal.runtime.chai.generate import generation_model

transformers = pytest.importorskip("transformers")

VOCAB = 61
HEADS, KV_HEADS, HIDDEN = 8, 4, 32
TINY = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64)
TOL = dict(rtol=1e-4, atol=1e-4)
D = HIDDEN // HEADS
WINDOW = dict(sliding_window=6, query_pre_attn_scalar=D)   # shorter than the sequences
ROTARY = {  # name: (config class, model class, config keywords beyond TINY)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=D)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),            # q/k norms, whole projection
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=D)),  # q/k norms per head
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=D, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=D, **WINDOW)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),     # partial rotary: refused
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=D, **WINDOW)),  # soft-capped
}
FAMILIES = ("llama", "qwen2", "mistral", "gemma", "mixtral", "phi3", "olmo2", "qwen3",
            "qwen3_moe", "gemma3", "gpt2", "opt")
"""Qwen3, Qwen3-MoE and Gemma 3 exist only in transformers 5 (skipped under 4.47); Mistral
and Gemma 3 run with a sliding window shorter than the sequences."""


def _model(name: str, impl: str = "sdpa", **extra):
    """A tiny causal LM of the family ``name`` (seeded weights five times the usual scale, so
    that heads differ enough for clusters to matter), in eval mode; skipped where this
    transformers has no such model."""
    t = transformers
    torch.manual_seed(0)
    init = {"init_std" if name == "opt" else "initializer_range": 0.1}
    extra = {**init, **extra}
    if name in ROTARY:
        config_name, model_name, kw = ROTARY[name]
        if not hasattr(t, model_name):
            pytest.skip(f"transformers {t.__version__} has no {model_name}")
        config = getattr(t, config_name)(**TINY, **kw, **extra, attn_implementation=impl)
        model = getattr(t, model_name)(config)
    elif name in ("gpt2", "gpt_bigcode"):
        config_cls, model_cls = {"gpt2": (t.GPT2Config, t.GPT2LMHeadModel),
                                 "gpt_bigcode": (t.GPTBigCodeConfig, t.GPTBigCodeForCausalLM)}[name]
        model = model_cls(config_cls(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=HEADS,
                                     n_positions=64, attn_implementation=impl, **extra))
    else:
        model = t.OPTForCausalLM(t.OPTConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=48, num_hidden_layers=2,
            num_attention_heads=HEADS, max_position_embeddings=64, word_embed_proj_dim=HIDDEN,
            pad_token_id=0, attn_implementation=impl, **extra))
    return model.eval()


def _scope(model, layer: int) -> str:
    """The module path of ``model``'s attention in decoder layer ``layer`` (what the pass's
    attention matcher records as a plan layer's scope)."""
    name = type(model).__name__
    if name.startswith(("GPT2", "GPTBigCode")):
        return f"transformer.h.{layer}.attn"
    if name.startswith("OPT"):
        return f"model.decoder.layers.{layer}.self_attn"
    return f"model.layers.{layer}.self_attn"


def _plan(model, k, mode: str = "online", labels=(), reps=()) -> ChaiPlan:
    """A plan by hand: ``k`` clusters in every layer (None: unclustered); ``labels``/``reps``
    CHAI-static's membership."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return ChaiPlan(tuple(
        LayerChoice(i, _scope(model, i), heads, kv, cfg.hidden_size // heads, k, k or heads,
                    static_labels=labels, static_reps=reps)
        for i in range(cfg.num_hidden_layers)), mode=mode)


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _gen(target, ids, new: int = 5, **kw):
    with torch.no_grad():
        return target.generate(ids, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                               return_dict_in_generate=True, output_logits=True, **kw)


def _cacheless_logits(gen, sequences) -> torch.Tensor:
    """The clustered model over whole sequences, no cache: every layer's attention clustered
    over every row at once."""
    with torch.no_grad():
        return gen(sequences, use_cache=False).logits


# --- the version differences, in one place ---

def test_hf_compat_reads_and_writes_hf_s_own_dynamic_cache():
    model = _model("llama")
    cache = transformers.DynamicCache()
    _gen(model, _ids(2, 7), new=3, **{hf_compat.generate_cache_keyword(): cache})
    held = hf_compat.layers_kv(cache)
    assert [tuple(k.shape) for k, _ in held] == [(2, KV_HEADS, 9, HIDDEN // HEADS)] * 2
    assert k_bytes(cache) == 2 * 2 * KV_HEADS * 9 * (HIDDEN // HEADS) * 4
    k, v = hf_compat.layer_kv(cache, 1)
    hf_compat.set_layer_kv(cache, 1, k[:, :1], v)
    assert hf_compat.layer_kv(cache, 1)[0].shape[1] == 1 and cache.get_seq_length() == 9


def test_rope_settings_of_either_config_style():
    assert hf_compat.rope(transformers.LlamaConfig(rope_theta=5000.0)) == (5000.0, "default", 1.0)
    scaled = transformers.LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert hf_compat.rope(scaled).kind == "linear"
    assert hf_compat.rope(transformers.StableLmConfig()).partial == 0.25


def test_passed_cache_and_attention_outputs():
    call = {"hidden_states": 1, "past_key_value": None, "cache": "c"}
    assert hf_compat.passed_cache(call) == "c" and call == {"hidden_states": 1}
    out = hf_compat.attention_outputs("out", None, "present")
    assert out == (("out", None) if hf_compat.transformers_major() >= 5
                   else ("out", None, "present"))


# --- at one head per cluster: Hugging Face's generate ---

@pytest.mark.parametrize("name", FAMILIES)
def test_one_head_per_cluster_is_hf_generate(name):
    model = _model(name)
    ids = _ids(2, 8)
    ours = _gen(generation_model(model, _plan(model, HEADS)), ids, do_sample=False)
    theirs = _gen(model, ids, do_sample=False)
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(theirs.logits), **TOL)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_sampling_with_one_head_per_cluster_is_hf_sampling(name):
    model = _model(name)
    gen = generation_model(model, _plan(model, HEADS))
    ids = _ids(2, 8)
    runs = []
    for target in (gen, model):
        torch.manual_seed(11)
        runs.append(_gen(target, ids, new=6, do_sample=True, top_k=20).sequences)
    assert torch.equal(*runs)


# --- clustered: the cache-less forward, single runs, the side decoder ---

@pytest.mark.parametrize("name", FAMILIES)
def test_clustered_generate_is_the_cacheless_forward(name):
    model = _model(name)
    gen = generation_model(model, _plan(model, 2))
    ids = _ids(2, 9, seed=3)
    out = _gen(gen, ids, new=6, do_sample=False)
    whole = _cacheless_logits(gen, out.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), whole[:, 8:14], **TOL)
    with torch.no_grad():  # it clusters: it is not the model
        assert (whole - model(out.sequences).logits).abs().max() > 1e-3


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_sampling_clustered_is_the_cacheless_forward(impl):
    model = _model("llama", impl)
    gen = generation_model(model, _plan(model, 2))
    torch.manual_seed(4)
    out = _gen(gen, _ids(2, 9), new=6, do_sample=True, temperature=1.5)
    torch.testing.assert_close(torch.stack(out.logits, 1),
                               _cacheless_logits(gen, out.sequences)[:, 8:14], **TOL)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_cache_holds_exactly_the_kept_k_heads(name):
    model = _model(name)
    plan = _plan(model, 3)
    gen = generation_model(model, plan)
    cache = gen.new_cache()
    _gen(gen, _ids(1, 10), new=4, do_sample=False, past_key_values=cache)
    length = 10 + 4 - 1          # the last token is sampled, never fed
    want_k = want_v = 0
    for c in plan.layers:
        (mem,) = cache.memberships(c.layer)
        kept = len({c.kv_of_head[r] for r in mem.representatives})
        want_k += kept * length * c.head_dim * 4
        want_v += c.num_kv_heads * length * c.head_dim * 4
        assert cache[c.layer][0].shape == (1, kept, length, c.head_dim)
        assert cache[c.layer][1].shape == (1, c.num_kv_heads, length, c.head_dim)
    assert cache.k_cache_bytes() == k_bytes(cache) == want_k
    assert cache.v_cache_bytes() == want_v and want_k < want_v
    assert cache.get_seq_length() == length
    if name == "gpt2":  # multi-head attention: K of exactly k heads per layer
        assert cache.k_cache_bytes() * HEADS == cache.v_cache_bytes() * 3


def test_batch_of_three_equals_three_single_runs():
    model = _model("llama")
    gen = generation_model(model, _plan(model, 2))
    ids = _ids(3, 10, seed=7)
    cache = gen.new_cache()
    batch = _gen(gen, ids, do_sample=False, past_key_values=cache)
    assert any(len(set(cache.memberships(layer))) > 1 for layer in (0, 1))
    for i in range(3):
        single = _gen(gen, ids[i:i + 1], do_sample=False)
        assert torch.equal(batch.sequences[i:i + 1], single.sequences)
        torch.testing.assert_close(torch.stack(batch.logits)[:, i:i + 1],
                                   torch.stack(single.logits), **TOL)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "opt"])
def test_left_padded_batch_equals_single_runs(name, impl):
    model = _model(name, impl)
    gen = generation_model(model, _plan(model, 2))
    lengths = (11, 7, 3)        # the 3-token prompt fixes its clusters while decoding
    prompts = [_ids(1, n, seed=10 + n)[0] for n in lengths]
    width = max(lengths)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    batch = _gen(gen, ids, new=6, do_sample=False, attention_mask=mask)
    for i, p in enumerate(prompts):
        single = _gen(gen, p[None], new=6, do_sample=False)
        assert torch.equal(batch.sequences[i, width:], single.sequences[0, len(p):])
        torch.testing.assert_close(torch.stack(batch.logits)[:, i:i + 1],
                                   torch.stack(single.logits), **TOL)


@pytest.mark.parametrize("mode,batch", [("online", 1), ("static", 2)])
def test_llama_generates_what_the_side_decoder_does(mode, batch):
    model = _model("llama", tie_word_embeddings=False, rope_theta=5000.0)
    labels, reps = (0, 0, 1, 1, 0, 0, 1, 1), (0, 2)
    plan = _plan(model, 2, mode, labels if mode == "static" else (),
                 reps if mode == "static" else ())
    ids = _ids(batch, 10, seed=5)
    ours = _gen(generation_model(model, plan), ids, new=6, do_sample=False).sequences
    side = ChaiDecoder(model, plan=plan).generate(ids, 6)
    assert torch.equal(ours, side)


# --- ChaiDecoder reads the config of either version ---

def test_side_decoder_takes_the_rotary_base_from_the_config():
    model = _model("llama", rope_theta=5000.0)
    dec = ChaiDecoder(model)
    assert dec.theta == 5000.0
    ids = _ids(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(dec.prefill(ids)[0], model(ids).logits, **TOL)


def test_side_decoder_refuses_scaled_rotary_by_name():
    model = _model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="rope type 'linear'"):
        ChaiDecoder(model)


# --- what is refused, and how ---

def test_clear_errors():
    model = _model("llama")
    gen = generation_model(model, _plan(model, 2))
    ids = _ids(1, 9)
    with pytest.raises(NotImplementedError, match="beam search"):
        gen.generate(ids, max_new_tokens=3, num_beams=2, pad_token_id=0)
    with pytest.raises(TypeError, match="ClusteredKCache"):
        gen.generate(ids, max_new_tokens=3, past_key_values=transformers.DynamicCache())
    with pytest.raises(TypeError, match="once"):
        gen.generate(ids, max_new_tokens=3, past_key_values=gen.new_cache(),
                     cache=gen.new_cache())
    right = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0, 0]])
    with pytest.raises(ValueError, match="right padding"):
        gen.generate(ids, attention_mask=right, max_new_tokens=2, pad_token_id=0)
    with pytest.raises(TypeError, match="update"):   # the model's own attention on our cache
        model(ids, **{hf_compat.generate_cache_keyword(): gen.new_cache()})


def test_the_cache_keyword_of_either_version_is_taken():
    model = _model("gpt2")
    gen = generation_model(model, _plan(model, 2))
    ids = _ids(1, 8)
    runs = []
    for keyword in ("cache", "past_key_values"):
        cache = gen.new_cache()
        runs.append(_gen(gen, ids, do_sample=False, **{keyword: cache}).sequences)
        assert cache.get_seq_length() == 8 + 5 - 1
    assert torch.equal(*runs)


@pytest.mark.parametrize("name", ["stablelm", "gpt_bigcode"])
def test_a_lookalike_attention_is_refused_by_name(name):
    # StableLM's modules look Llama-style but rotate part of each head; GPT-BigCode's look
    # like GPT-2's but keep one K/V head (multi-query)
    model = _model(name)
    module = type(model.get_submodule(_scope(model, 0))).__name__
    with pytest.raises(TypeError, match=f"cannot run .*{module} at .*taken for"):
        generation_model(model, _plan(model, 2))


def test_soft_capped_scores_are_refused_by_name():
    # Gemma 2 caps its scores with tanh: at one head per cluster on a random model the copy
    # differs by 1e-4, too little for the family check, so the cap itself is refused
    model = _model("gemma2", "eager")   # transformers 5 has no sdpa for Gemma 2
    with pytest.raises(TypeError, match=r"model.layers.0.self_attn \(Gemma2Attention\) "
                                        r"soft-caps its scores"):
        generation_model(model, _plan(model, 2))


def test_left_padding_is_read_past_sliding_windows_and_unmasked_rows():
    from tidal.runtime.chai.cache import left_pads

    i = torch.arange(9)
    causal = i[None, :] <= i[:, None]
    window = (causal & (i[:, None] - i[None, :] < 6))[None, None]
    assert left_pads(window, 1, 9) == [0]       # late rows do not see early columns
    real = torch.ones(2, 9, dtype=torch.bool)
    real[0, :3] = False
    padded = causal[None, None] & real[:, None, None, :]
    assert left_pads(padded, 2, 9) == [3, 0]
    unmasked = padded | ~padded.any(-1, keepdim=True)   # padding rows let attend everything
    assert left_pads(unmasked, 2, 9) == [3, 0]
    right = causal[None, None] & (i < 6)[None, None, None, :]
    with pytest.raises(ValueError, match="right padding"):
        left_pads(right, 1, 9)


def test_the_cache_grows_in_place_past_its_buffer(monkeypatch):
    from tidal.runtime.chai import cache as chai_cache

    monkeypatch.setattr(chai_cache, "GROWTH", 2)
    model = _model("llama")
    gen = generation_model(model, _plan(model, 2))
    cache = gen.new_cache()
    out = _gen(gen, _ids(2, 8), new=8, do_sample=False, past_key_values=cache)
    torch.testing.assert_close(torch.stack(out.logits, 1),
                               _cacheless_logits(gen, out.sequences)[:, 7:15], **TOL)
    for layer in (0, 1):
        assert cache[layer][0].shape[2] == cache[layer][1].shape[2] == 8 + 8 - 1
        assert cache.stores[(layer, "v")].shape[2] <= 8 + 8 - 1 + 2


def test_unclustered_layers_keep_k_whole():
    model = _model("llama")
    plan = _plan(model, 2)
    plan = replace(plan, layers=(replace(plan.layers[0], chosen_k=None),) + plan.layers[1:])
    gen = generation_model(model, plan)
    cache = gen.new_cache()
    out = _gen(gen, _ids(1, 9), new=4, do_sample=False, past_key_values=cache)
    assert cache[0][0].shape[1] == KV_HEADS and cache[1][0].shape[1] < KV_HEADS
    assert cache.memberships(0) == [None]
    torch.testing.assert_close(torch.stack(out.logits, 1),
                               _cacheless_logits(gen, out.sequences)[:, 8:12], **TOL)
    assert isinstance(cache, ClusteredKCache)
