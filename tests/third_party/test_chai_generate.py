"""CHAI in Hugging Face ``generate`` (issue 20, item 2): ``compiled.generate`` runs the model's
own attention modules clustered over ``ClusteredKCache``, which keeps K only for the KV heads
representatives read.

Reference semantics: with one head per cluster, Hugging Face's own ``generate``; with fewer, the
compiled graph (``clustered_attention``) run on the generated sequence (teacher forcing), and
tidal's side decoder ``ChaiDecoder`` for Llama. Tolerances: logits within 1e-4 (float32, kernels
of different shapes). A model is exported once per config and input shape for the whole module
(``reusing_exports``): each test rebuilds the graph on its own fresh model."""
import pytest
import torch

import tidal
from tidal.ir.export_capture import ExportCache, reusing_exports
from tidal.passes.clustered_attention import ClusteredAttention
from tidal.runtime.chai.decode import ChaiDecoder

transformers = pytest.importorskip("transformers")

VOCAB = 97
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
TOL = dict(rtol=1e-4, atol=1e-4)
NEWER = {"olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
         "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
         "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
             head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
         "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
             head_dim=8, sliding_window=6, query_pre_attn_scalar=8))}
"""Decoders with q/k norms (OLMo 2 over the projection, the others per head); Qwen3, Qwen3-MoE
and Gemma 3 exist only in transformers 5."""


@pytest.fixture(scope="module")
def exports():
    return ExportCache()


@pytest.fixture(autouse=True)
def _reusing(exports):
    with reusing_exports(exports):
        yield


def _decoder(name: str, impl: str = "sdpa"):
    t = transformers
    torch.manual_seed(0)
    if name in ("llama", "qwen2", "mistral"):
        config_cls, model_cls = {"llama": (t.LlamaConfig, t.LlamaForCausalLM),
                                 "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM),
                                 "mistral": (t.MistralConfig, t.MistralForCausalLM)}[name]
        model = model_cls(config_cls(**SMALL, attn_implementation=impl))
    elif name == "gpt2":
        model = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=8,
                                               n_positions=128, attn_implementation=impl))
    elif name == "mixtral":  # rotary tables by length, indexed by position ids
        model = t.MixtralForCausalLM(t.MixtralConfig(**SMALL, num_local_experts=4,
                                                     num_experts_per_tok=2,
                                                     attn_implementation=impl))
    elif name == "phi3":  # one fused qkv_proj
        model = t.Phi3ForCausalLM(t.Phi3Config(**SMALL, pad_token_id=0,
                                               attn_implementation=impl))
    elif name == "gemma":  # not on transformers.utils.fx's list: traced by tidal's fallback
        model = t.GemmaForCausalLM(t.GemmaConfig(**SMALL, head_dim=8, attn_implementation=impl))
    elif name in NEWER:  # q/k norms; Gemma 3 with a sliding window shorter than the sequences
        config_name, model_name, extra = NEWER[name]
        if not hasattr(t, model_name):
            pytest.skip(f"transformers {t.__version__} has no {model_name}")
        model = getattr(t, model_name)(getattr(t, config_name)(
            **SMALL, **extra, attn_implementation=impl))
    elif name == "stablelm":  # Llama-like modules, partial rotary: refused
        model = t.StableLmForCausalLM(t.StableLmConfig(**SMALL, attn_implementation=impl))
    elif name == "gpt_bigcode":  # GPT-2-like modules, multi-query cache: refused
        model = t.GPTBigCodeForCausalLM(t.GPTBigCodeConfig(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=8, n_positions=128,
            attn_implementation=impl))
    else:
        model = t.OPTForCausalLM(t.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128,
                                             num_hidden_layers=2, num_attention_heads=8,
                                             max_position_embeddings=128, word_embed_proj_dim=64,
                                             attn_implementation=impl, pad_token_id=0))
    return model.eval()


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _compiled(model, ids, k):
    return tidal.compile(model, (ids,), passes=[ClusteredAttention(clusters=k)])


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out["logits"]


def _gen(target, ids, new=6, **kw):
    return target.generate(ids, max_new_tokens=new, pad_token_id=0, return_dict_in_generate=True,
                           output_logits=True, **kw)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gpt2", "opt", "gemma",
                                  "mixtral", "phi3", *NEWER])
def test_one_head_per_cluster_is_hf_generate(name):
    model = _decoder(name)
    ids = _ids(2, 9)
    compiled = _compiled(model, ids, 8)
    ours, theirs = _gen(compiled, ids, do_sample=False), _gen(model, ids, do_sample=False)
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(theirs.logits), **TOL)


@pytest.mark.parametrize("name,impl", [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa"),
                                       ("opt", "sdpa"), ("mixtral", "sdpa"), ("phi3", "sdpa"),
                                       ("olmo2", "sdpa"), ("qwen3", "sdpa"), ("gemma3", "sdpa")])
def test_clustered_generate_is_the_graph_teacher_forced(name, impl):
    model = _decoder(name, impl)
    ids = _ids(1, 11)
    compiled = _compiled(model, ids, 2)
    out = _gen(compiled, ids, new=7, do_sample=False)
    with torch.no_grad():
        graph = _logits(compiled(out.sequences))
    torch.testing.assert_close(torch.stack(out.logits, 1), graph[:, 10:17], **TOL)
    # the compiled graph is the reference only if it clusters too: it differs from the model
    with torch.no_grad():
        assert (graph - model(out.sequences).logits).abs().max() > 1e-3


def test_generate_equals_the_side_decoder_on_the_zoo_llama():
    from examples.models import llama_small

    torch.manual_seed(0)  # the zoo model's weights come from the global generator
    zoo = llama_small().eval()
    cfg = zoo.config
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=getattr(cfg, "rope_theta", 10000.0), tie_word_embeddings=False,
        attn_implementation="sdpa"))
    missing = hf.load_state_dict(zoo.state_dict(), strict=False)
    assert not missing.missing_keys, missing
    hf.eval()
    ids = torch.randint(1, cfg.vocab_size, (1, 14), generator=torch.Generator().manual_seed(3))
    compiled = _compiled(hf, ids, 1)
    ours = compiled.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    side = ChaiDecoder(hf, plan=compiled.plan.get("clustered_attention")).generate(ids, 8)
    # HF generate stops at the end-of-sequence token; the side decoder runs all 8 steps
    assert ours.shape[1] == side.shape[1] or ours[0, -1] == hf.generation_config.eos_token_id
    assert torch.equal(ours, side[:, :ours.shape[1]])
    assert ours.shape[1] > ids.shape[1] + 1  # more than one token compared


def test_generate_equals_the_graph_on_a_gpt2_config_greedy_tokens():
    model = _decoder("gpt2")
    ids = _ids(1, 10, seed=5)
    compiled = _compiled(model, ids, 3)
    ours = compiled.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    seq = ids
    with torch.no_grad():  # greedy by recomputing the whole sequence through the graph
        for _ in range(6):
            seq = torch.cat((seq, _logits(compiled(seq))[:, -1:].argmax(-1)), dim=1)
    assert torch.equal(ours, seq)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_cache_holds_exactly_the_kept_k_heads(name):
    model = _decoder(name)
    ids = _ids(1, 12)
    compiled = _compiled(model, ids, 3)
    cache = compiled.new_cache()
    compiled.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                      past_key_values=cache)
    plan = compiled.plan.get("clustered_attention")
    length = 12 + 4 - 1          # the last token is sampled, never fed
    want_k = want_v = 0
    for c in plan.layers:
        (mem,) = cache.memberships(c.layer)
        kept = len({c.kv_of_head[r] for r in mem.representatives})
        want_k += kept * length * c.head_dim * 4
        want_v += c.num_kv_heads * length * c.head_dim * 4
        assert cache[c.layer][0].shape == (1, kept, length, c.head_dim)
    assert cache.k_cache_bytes() == want_k and cache.v_cache_bytes() == want_v
    assert want_k < want_v
    if name == "gpt2":  # multi-head attention: K of exactly k heads per layer
        assert cache.k_cache_bytes() * 8 == cache.v_cache_bytes() * 3


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_batch_of_three_equals_three_single_runs(name):
    model = _decoder(name)
    ids = _ids(3, 10, seed=7)
    compiled = _compiled(model, ids, 2)
    cache = compiled.new_cache()
    batch = _gen(compiled, ids, do_sample=False, past_key_values=cache)
    memberships = [cache.memberships(layer) for layer in (0, 1)]
    assert any(len(set(per_seq)) > 1 for per_seq in memberships), memberships
    for i in range(3):
        single = _gen(compiled, ids[i:i + 1], do_sample=False)
        assert torch.equal(batch.sequences[i:i + 1], single.sequences)
        torch.testing.assert_close(torch.stack(batch.logits)[:, i:i + 1],
                                   torch.stack(single.logits), **TOL)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_left_padded_batch_equals_single_runs(name):
    model = _decoder(name)
    lengths = (12, 7, 3)        # the 3-token prompt fixes its clusters while decoding
    prompts = [_ids(1, n, seed=10 + n)[0] for n in lengths]
    width = max(lengths)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    compiled = _compiled(model, _ids(1, 12), 2)
    batch = _gen(compiled, ids, new=6, do_sample=False, attention_mask=mask)
    for i, p in enumerate(prompts):
        single = _gen(compiled, p[None], new=6, do_sample=False)
        assert torch.equal(batch.sequences[i, width:], single.sequences[0, len(p):])
        torch.testing.assert_close(torch.stack(batch.logits)[:, i:i + 1],
                                   torch.stack(single.logits), **TOL)


def test_sampling_with_one_head_per_cluster_is_hf_sampling():
    model = _decoder("llama")
    ids = _ids(2, 9)
    compiled = _compiled(model, ids, 8)
    torch.manual_seed(11)
    ours = compiled.generate(ids, max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0)
    torch.manual_seed(11)
    theirs = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0)
    assert torch.equal(ours, theirs)


def test_sampling_clustered_is_the_graph_teacher_forced():
    model = _decoder("llama")
    ids = _ids(1, 9)
    compiled = _compiled(model, ids, 2)
    torch.manual_seed(4)
    out = _gen(compiled, ids, new=6, do_sample=True, temperature=1.5)
    with torch.no_grad():
        graph = _logits(compiled(out.sequences))
    torch.testing.assert_close(torch.stack(out.logits, 1), graph[:, 8:14], **TOL)


def test_the_model_is_left_as_it_was():
    model = _decoder("llama")
    ids = _ids(1, 9)
    before = _gen(model, ids, do_sample=False)
    with reusing_exports(reuse=False):   # exported here: what the export leaves is under test
        compiled = _compiled(model, ids, 2)
    clustered = _gen(compiled, ids, do_sample=False)
    assert "forward" not in vars(model.model.layers[0].self_attn)
    after = _gen(model, ids, do_sample=False)
    assert torch.equal(torch.stack(after.logits), torch.stack(before.logits))
    assert not torch.equal(torch.stack(clustered.logits), torch.stack(before.logits))
    assert model.config.use_cache  # tracing does not leave the model's config changed


def test_clear_errors():
    model = _decoder("llama")
    ids = _ids(1, 9)
    compiled = _compiled(model, ids, 2)
    with pytest.raises(NotImplementedError, match="beam search"):
        compiled.generate(ids, max_new_tokens=3, num_beams=2, pad_token_id=0)
    with pytest.raises(TypeError, match="ClusteredKCache"):
        compiled.generate(ids, max_new_tokens=3, past_key_values=transformers.DynamicCache())
    right = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0, 0]])
    with pytest.raises(ValueError, match="right padding"):
        compiled.generate(ids, attention_mask=right, max_new_tokens=2, pad_token_id=0)
    with pytest.raises(TypeError, match="update"):   # the model's own attention on our cache
        model(ids, past_key_values=compiled.new_cache())
    plain = tidal.compile(model, (ids,), passes=[])
    with pytest.raises(ValueError, match="clustered_attention"):
        plain.generate(ids, max_new_tokens=2)


@pytest.mark.parametrize("how", ["kmeans", "static"])
def test_kmeans_and_static_plans_generate_as_the_graph(how):
    from dataclasses import replace

    model = _decoder("llama")
    ids = _ids(2, 10, seed=21)
    if how == "kmeans":
        compiled = tidal.compile(model, (ids,), passes=[ClusteredAttention(2, clustering=how)])
    else:
        plan = _compiled(model, ids, 2).plan.get("clustered_attention")
        layers = tuple(replace(c, static_labels=(0, 0, 1, 1, 0, 0, 1, 1), static_reps=(0, 2))
                       for c in plan.layers)
        compiled = tidal.compile(model, (ids,), passes=[ClusteredAttention(
            plan=replace(plan, layers=layers), mode="static")])
    assert compiled.plan.get("clustered_attention").clustering == \
        ("kmeans" if how == "kmeans" else "linkage")
    out = _gen(compiled, ids, do_sample=False)
    with torch.no_grad():
        graph = _logits(compiled(out.sequences))
    torch.testing.assert_close(torch.stack(out.logits, 1), graph[:, 9:15], **TOL)


def test_a_layout_that_saves_nothing_scores_every_head_and_keeps_k_whole():
    from tidal.ir.head_clusters import Membership
    from tidal.ir.representative_k_cache import k_cache_layout

    kv = (0, 0, 1, 1, 2, 2, 3, 3)
    # 6 clusters over 4 KV heads, two representatives on KV heads 0 and 1: 4 slots x 2 rows = 8
    spread = Membership((0, 1, 2, 3, 4, 4, 5, 5), (0, 1, 2, 3, 4, 6))
    assert k_cache_layout([spread], kv, torch.device("cpu")).whole
    fewer = Membership((0, 0, 0, 0, 1, 1, 1, 1), (0, 4))      # 2 slots x 1 row: saves
    assert not k_cache_layout([fewer], kv, torch.device("cpu")).whole
    assert not k_cache_layout([spread, fewer], kv, torch.device("cpu")).whole   # slots padded


def test_mild_clustering_generates_as_the_graph():
    model = _decoder("llama")
    ids = _ids(2, 10, seed=9)
    compiled = _compiled(model, ids, 6)
    cache = compiled.new_cache()
    out = _gen(compiled, ids, do_sample=False, past_key_values=cache)
    with torch.no_grad():
        graph = _logits(compiled(out.sequences))
    torch.testing.assert_close(torch.stack(out.logits, 1), graph[:, 9:15], **TOL)


@pytest.mark.parametrize("name", ["stablelm", "gpt_bigcode"])
def test_a_lookalike_attention_is_refused_not_decoded_wrongly(name):
    # StableLM's modules look Llama-style (q/k/v/o projections, rotary) but rotate part of
    # each head; GPT-BigCode's look like GPT-2's but keep one K/V head in a fused cache.
    # Without check_family the first fails deep inside transformers and the second would
    # decode with the wrong cache layout. (Their classes are StableLmSdpaAttention and
    # GPTBigCodeSdpaAttention in transformers 4.47, StableLmAttention and GPTBigCodeAttention
    # in 5.)
    model = _decoder(name)
    module = type(model.get_submodule("model.layers.0.self_attn" if name == "stablelm"
                                      else "transformer.h.0.attn")).__name__
    ids = _ids(1, 9)
    compiled = _compiled(model, ids, 2)
    with pytest.raises(TypeError, match=f"cannot run .*{module} at .*taken for"):
        compiled.generate(ids, max_new_tokens=3, pad_token_id=0)


def test_generate_says_why_it_cannot_run_bloom():
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=8)).eval()
    ids = _ids(1, 9)
    compiled = _compiled(model, ids, 2)
    if compiled.plan.get("clustered_attention") is None:
        # transformers 4.47: Bloom's alibi scores (baddbmm) are not an attention pattern the
        # pass knows, so there is no plan to generate with
        with pytest.raises(ValueError, match="found nothing to cluster in BloomForCausalLM: "
                                             "no attention found"):
            compiled.generate(ids, max_new_tokens=3, pad_token_id=0)
    else:
        # transformers 5: the graph's attention is found; generation refuses the family
        with pytest.raises(TypeError, match=r"transformer.h.0.self_attention \(BloomAttention\)"
                                            r" is not a Llama-style, GPT-2 or OPT attention"):
            compiled.generate(ids, max_new_tokens=3, pad_token_id=0)


def test_the_family_check_ignores_the_models_dropout():
    # the check compares against the model itself; a model left in training mode with
    # attention dropout must be compared without it, not refused
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, attention_dropout=0.5)).train()
    ids = _ids(1, 9)
    compiled = _compiled(model, ids, 2)
    assert compiled.generate(ids, max_new_tokens=3, pad_token_id=0).shape == (1, 12)
    assert model.training


def test_the_cache_grows_in_place_past_its_buffer(monkeypatch):
    # each step writes its token into the layer's buffer; with room for 2 more tokens the
    # buffers are replaced (held K/V copied) every few steps, K also when it is cut
    from tidal.runtime.chai import cache as chai_cache

    monkeypatch.setattr(chai_cache, "GROWTH", 2)
    model = _decoder("llama")
    ids = _ids(2, 9)
    compiled = _compiled(model, ids, 2)
    cache = compiled.new_cache()
    out = _gen(compiled, ids, new=9, do_sample=False, past_key_values=cache)
    with torch.no_grad():
        graph = _logits(compiled(out.sequences))
    torch.testing.assert_close(torch.stack(out.logits, 1), graph[:, 8:17], **TOL)
    length = 9 + 9 - 1
    for layer in (0, 1):
        assert cache[layer][0].shape[2] == cache[layer][1].shape[2] == length
        assert cache.stores[(layer, "v")].shape[2] <= length + 2
