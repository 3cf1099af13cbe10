"""CHAI through ``tidal.compile()`` and Hugging Face ``generate`` on SmolLM2-135M (real weights).

For a fixed k = 3 in every layer and for the budgeted plan (``calibrate``, perplexity within
``--tolerance``; or ``--plan plan.json`` from ``benchmarks/chai.py --save-plan``):

- time to next token (TTNT, greedy, ``--new-tokens`` tokens after the prompt, timed token by
  token with a streamer) at each context, ``compiled.generate`` (the model's own sdpa attention
  modules over ``ClusteredKCache``) against Hugging Face ``generate`` on the unmodified model
  with its default ``DynamicCache`` (the same cache type otherwise: both grow by
  concatenation), run alternately in the same process; the unclustered plan through the same
  path (k = H) shows what the path itself costs;
- the side decoder's speedup at the same k (``ChaiDecoder`` clustered vs unclustered, sharing
  weights), and the share of it the clustering realises on the compile() path: (speedup of
  k = 3 over k = H on that path - 1) / (side speedup - 1); goal >= 80 % at fixed k, and the
  budgeted plan never slower than unclustered. The compile() path against HF ``generate`` is
  printed beside it (it also gains from reading grouped K/V heads without copying them);
- K-cache bytes held after the generation, against the unmodified model's ``DynamicCache``;
- perplexity on held-out text of each plan against the original (the compiled graph).

Needs ``make attention-models``. Run (1 thread; about 15 min on a quiet 2-core machine):

    python benchmarks/chai_generate.py                    # contexts 2048 4096, calibrates
    python benchmarks/chai_generate.py --plan plan.json   # budgeted plan from chai.py
    python benchmarks/chai_generate.py --contexts 512 --new-tokens 4 --repeats 1   # a look
    python benchmarks/chai_generate.py --device cuda      # the same on a GPU

``--tiny`` needs no weights: a small random Llama (``tiny_llama``) and only the decode timings
(``tiny_ttnt``: HF ``generate`` against ``compiled.generate`` at k and at k = H, and the side
decoder), printed as a table and one JSON line; a harness calls ``tiny_ttnt(device)`` itself:

    python benchmarks/chai_generate.py --tiny --device cuda --contexts 1024 --new-tokens 32
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tidal  # noqa: E402
from benchmarks.chai import _chunks, _Clock  # noqa: E402
from examples.data import calibration_text, evaluation_text  # noqa: E402
from tidal.ir.plan import Plan  # noqa: E402
from tidal.ir.plans.chai import ChaiPlan  # noqa: E402
from tidal.passes.chai_calibrate import Budget  # noqa: E402
from tidal.passes.clustered_attention import (ClusteredAttention, calibrate,  # noqa: E402
                                              clustered_graph, perplexity)
from tidal.runtime.chai import hf_compat  # noqa: E402
from tidal.runtime.chai.cache import k_bytes  # noqa: E402
from tidal.runtime.chai.decode import ChaiDecoder  # noqa: E402
from tidal.runtime.chai.smollm2 import load_smollm2  # noqa: E402


def _ttnt_generate(target, ids: torch.Tensor, new: int, cache) -> tuple[float, object]:
    """Mean seconds per token after the first of one greedy ``target.generate(ids)`` with
    ``cache`` (under this transformers' keyword for it), and its output."""
    clock = _Clock()
    with torch.inference_mode():
        out = target.generate(ids, streamer=clock, do_sample=False, pad_token_id=0,
                              max_new_tokens=1 + new, min_new_tokens=1 + new,
                              return_dict_in_generate=True,
                              **{hf_compat.generate_cache_keyword(): cache})
    return (clock.times[-1] - clock.times[1]) / (len(clock.times) - 2), out


def _sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a GPU runs asynchronously to the host's clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ttnt_side(dec: ChaiDecoder, ids: torch.Tensor, new: int) -> float:
    """Mean seconds per greedy step of the side decoder after its prefill."""
    with torch.inference_mode():
        logits, state = dec.prefill(ids, ids.shape[1] + new + 1, last_only=True)
        tok = logits[:, -1:].argmax(-1)
        _sync(dec.device)
        t0 = time.perf_counter()
        for _ in range(new):
            tok = dec.step(tok, state)[:, -1:].argmax(-1)
        _sync(dec.device)
        return (time.perf_counter() - t0) / new


def tiny_llama(*, layers: int = 4, heads: int = 8, kv_heads: int = 4, hidden: int = 256,
               vocab: int = 512, positions: int = 2048, seed: int = 0) -> torch.nn.Module:
    """A random Llama-architecture LM (``transformers.LlamaConfig``, sdpa attention, grouped-
    query attention) in eval mode on the CPU: nothing to download. The global RNG is left as
    it was."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=positions,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).eval()


TINY_PATHS = {"hf": "HF generate (DynamicCache)", "compiled_k": "compiled.generate, k",
              "compiled_kH": "compiled.generate, k = H", "decoder_full": "ChaiDecoder, unclustered",
              "decoder_k": "ChaiDecoder, k"}
"""The paths ``tiny_ttnt`` times, by the key prefix of their figures."""


def tiny_ttnt(device: str = "cpu", *, context: int = 256, new_tokens: int = 8,
              repeats: int = 2, k: int = 2) -> dict:
    """CHAI decode against HF ``generate`` on ``device`` with ``tiny_llama``: time to next
    token (``<path>.ttnt_ms``, greedy, best of ``repeats`` alternating rounds after a warm-up
    round) of each of ``TINY_PATHS``: HF ``generate`` (``DynamicCache``), ``compiled.generate``
    at ``k`` clusters per layer and at one head per cluster (k = H: the path's own cost), and
    the side decoder ``ChaiDecoder`` unclustered and at ``k``; ``<path>.x_vs_hf`` the ratio to
    HF (> 1: faster); ``equal``: at k = H ``compiled.generate`` gives HF's tokens. One flat,
    JSON-ready dict.

    Example (a look on the CPU, a few seconds; ``device="cuda"`` on a GPU):
        >>> r = tiny_ttnt("cpu", context=32, new_tokens=2, repeats=1)
        >>> r["equal"], r["hf.x_vs_hf"], r["decoder_k.ttnt_ms"] > 0
        (True, 1.0, True)
    """
    dev = torch.device(device)
    model = tiny_llama(positions=context + new_tokens + 8).to(dev)
    cfg = model.config
    ids = torch.randint(1, cfg.vocab_size, (1, context),
                        generator=torch.Generator().manual_seed(1)).to(dev)
    fixed = tidal.compile(model, (ids,), passes=[ClusteredAttention(clusters=k)])
    whole = tidal.compile(model, (ids,), passes=[ClusteredAttention(
        clusters=cfg.num_attention_heads)])
    with torch.inference_mode():
        greedy = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        equal = torch.equal(whole.generate(ids, **greedy), model.generate(ids, **greedy))
    side = ChaiDecoder(model)
    runs = {
        "hf": lambda n: _ttnt_generate(model, ids, n, DynamicCache())[0],
        "compiled_k": lambda n: _ttnt_generate(fixed, ids, n, fixed.new_cache())[0],
        "compiled_kH": lambda n: _ttnt_generate(whole, ids, n, whole.new_cache())[0],
        "decoder_full": lambda n: _ttnt_side(side, ids, n),
        "decoder_k": lambda n: _ttnt_side(side.with_clusters(counts=k), ids, n),
    }
    for run in runs.values():   # warm-up: kernels, allocator, lazy initialisation
        run(2)
    best = {name: math.inf for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            best[name] = min(best[name], run(new_tokens))
    result = {"device": str(dev), "model": f"tiny random Llama ({cfg.num_hidden_layers} layers, "
              f"{cfg.num_attention_heads} heads, {cfg.num_key_value_heads} KV heads, hidden "
              f"{cfg.hidden_size}, fp32, sdpa)", "context": context, "new_tokens": new_tokens,
              "k": k, "equal": equal}
    for name, t in best.items():
        result[f"{name}.ttnt_ms"] = t * 1e3
        result[f"{name}.x_vs_hf"] = best["hf"] / t
    return result


def _print_tiny(result: dict) -> None:
    """``tiny_ttnt``'s result as a table, then as one JSON line."""
    print(f"# {result['model']} on {result['device']}: context {result['context']}, "
          f"{result['new_tokens']} timed tokens, k = {result['k']}; at k = H compiled.generate "
          f"gives HF's tokens: {result['equal']}")
    print(f"{'path':<28} {'TTNT ms':>8} {'x vs HF':>8}")
    for name, label in TINY_PATHS.items():
        print(f"{label:<28} {result[name + '.ttnt_ms']:>8.2f} {result[name + '.x_vs_hf']:>8.2f}")
    print(json.dumps(result), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+",
                        help="prompt lengths (default 2048 4096; --tiny: 256)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2,
                        help="alternating rounds per context; the best round counts")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--k", type=int, default=3, help="the fixed cluster count")
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="budgeted plan: perplexity within this share of the original")
    parser.add_argument("--calib-chunks", type=int, default=4)
    parser.add_argument("--eval-chunks", type=int, default=4)
    parser.add_argument("--chunk-len", type=int, default=512)
    parser.add_argument("--plan", help="the budgeted ChaiPlan JSON (else calibrate here)")
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, ...)")
    parser.add_argument("--tiny", action="store_true",
                        help="a small random Llama (no weights), decode timings only")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.tiny:
        for ctx in args.contexts or [256]:
            _print_tiny(tiny_ttnt(args.device, context=ctx, new_tokens=args.new_tokens,
                                  repeats=args.repeats, k=args.k))
        return 0
    args.contexts = args.contexts or [2048, 4096]
    device = torch.device(args.device)

    model, tok = load_smollm2("sdpa")
    model = model.to(device)
    calib_ids = tok(calibration_text(), return_tensors="pt").input_ids[0].to(device)
    eval_ids = tok(evaluation_text(), return_tensors="pt").input_ids[0].to(device)
    evals = _chunks(eval_ids, args.chunk_len, args.eval_chunks)
    threads = f"{torch.get_num_threads()} thread(s)" if device.type == "cpu" else str(device)
    print(f"# SmolLM2-135M-Instruct (GGUF Q4_1 dequantised, fp32, sdpa), {threads}; "
          f"greedy, {args.new_tokens} timed tokens")
    example = evals[0]
    fixed = tidal.compile(model, example, passes=[ClusteredAttention(clusters=args.k)])
    fixed_plan = fixed.plan.get("clustered_attention")
    if args.plan:
        budget_plan = Plan.from_json(Path(args.plan).read_text())
        if not isinstance(budget_plan, ChaiPlan):
            raise SystemExit(f"--plan {args.plan}: not a ChaiPlan")
        print(f"budgeted plan read from {args.plan}")
    else:
        t0 = time.perf_counter()
        calib = _chunks(calib_ids, args.chunk_len, args.calib_chunks)
        budget_plan = calibrate(model, calib, budget=Budget("perplexity", args.tolerance),
                                model_name="SmolLM2-135M",
                                log=lambda m: print("  calib:", m, flush=True))
        print(f"budgeted plan calibrated in {time.perf_counter() - t0:.0f} s")
    budget_plan = dataclasses.replace(budget_plan, mode="online")
    budgeted = tidal.compile(model, example, passes=[ClusteredAttention(plan=budget_plan)])
    none_plan = dataclasses.replace(fixed_plan, layers=tuple(
        dataclasses.replace(c, chosen_k=None) for c in fixed_plan.layers))
    unclustered = tidal.compile(model, example, passes=[ClusteredAttention(plan=none_plan)])
    again = tidal.compile(model, example, passes=[ClusteredAttention(plan=none_plan)])
    variants = {f"fixed k={args.k}": fixed, "budgeted": budgeted, "unclustered (k=H)": unclustered,
                "unclustered again": again}  # the same path twice: the noise floor
    print(f"budgeted plan: {budget_plan.summary()}")

    base = perplexity(clustered_graph(model, example), evals)
    print(f"\n## held-out perplexity ({len(evals)}x{args.chunk_len} tokens), the compiled graph")
    print(f"{'plan':<20} {'perplexity':>10} {'vs original':>11}")
    print(f"{'original':<20} {base:>10.3f}")
    for name in (f"fixed k={args.k}", "budgeted"):
        plan = fixed_plan if name.startswith("fixed") else budget_plan
        ppl = perplexity(clustered_graph(model, example, ClusteredAttention(plan=plan)), evals)
        print(f"{name:<20} {ppl:>10.3f} {ppl / base - 1:>+11.1%}", flush=True)

    side_full = ChaiDecoder(model)
    side_k = side_full.with_clusters(plan=fixed_plan)
    print(f"\n## time to next token (ms; best of {args.repeats} alternating rounds); "
          f"x = HF generate / this (>1: faster)")
    print(f"{'context':>7} {'path':<38} {'TTNT ms':>8} {'x':>6} {'K-cache MB':>10} "
          f"{'K saved':>7}")
    for ctx in args.contexts:
        reps = -(-ctx // eval_ids.numel())
        ids = eval_ids.repeat(reps)[:ctx].unsqueeze(0)
        best = {n: math.inf for n in ["HF generate (DynamicCache)", *variants, "side full",
                                      f"side k={args.k}"]}
        kbytes = {}
        for _ in range(args.repeats):
            cache = DynamicCache()
            t, out = _ttnt_generate(model, ids, args.new_tokens, cache)
            best["HF generate (DynamicCache)"] = min(best["HF generate (DynamicCache)"], t)
            kbytes["HF generate (DynamicCache)"] = k_bytes(cache)
            del out, cache
            for name, compiled in variants.items():
                cache = compiled.new_cache()
                t, out = _ttnt_generate(compiled, ids, args.new_tokens, cache)
                best[name] = min(best[name], t)
                kbytes[name] = cache.k_cache_bytes()
                del out, cache
            best["side full"] = min(best["side full"], _ttnt_side(side_full, ids,
                                                                  args.new_tokens))
            best[f"side k={args.k}"] = min(best[f"side k={args.k}"],
                                           _ttnt_side(side_k, ids, args.new_tokens))
        hf = best["HF generate (DynamicCache)"]
        for name, t in best.items():
            if name.startswith("side"):
                continue
            kb = kbytes[name]
            saved = 1 - kb / kbytes["HF generate (DynamicCache)"]
            label = name if name.startswith("HF") else f"compile()+generate, {name}"
            print(f"{ctx:>7} {label:<38} {t * 1e3:>8.1f} {hf / t:>6.2f} {kb / 2**20:>10.1f} "
                  f"{saved:>7.1%}")
        side_speedup = best["side full"] / best[f"side k={args.k}"]
        ours = hf / best[f"fixed k={args.k}"]
        own = best["unclustered (k=H)"] / best[f"fixed k={args.k}"]
        for name in ("side full", f"side k={args.k}"):
            print(f"{ctx:>7} {'ChaiDecoder, ' + name[5:]:<38} {best[name] * 1e3:>8.1f}")
        share = (own - 1) / (side_speedup - 1) if side_speedup > 1.02 else math.nan  # noise
        verdict = "the side decoder gains < 2 %, within noise" if math.isnan(share) else \
            ("met" if share >= 0.8 else "NOT met")
        plain = best["unclustered (k=H)"]
        noise = abs(best["unclustered again"] / plain - 1)
        budget_x = plain / best["budgeted"]
        slower = "met" if budget_x >= 1 - noise else "NOT met"
        saved_ms = (best["unclustered (k=H)"] - best[f"fixed k={args.k}"]) * 1e3
        side_saved_ms = (best["side full"] - best[f"side k={args.k}"]) * 1e3
        print(f"{ctx:>7} fixed k={args.k}: the clustering alone (same path, k=H / k={args.k}) "
              f"{own:.3f}x against the side decoder's {side_speedup:.3f}x: {share:.0%} of its "
              f"gain (goal >= 80 %: {verdict}); in time saved per token {saved_ms:.1f} of the "
              f"side decoder's {side_saved_ms:.1f} ms; compile() path vs HF generate {ours:.3f}x; "
              f"budgeted vs the unclustered path {budget_x:.3f}x, the same path twice differs "
              f"by {noise:.1%} (goal never slower, beyond that noise: {slower}; "
              f"{budget_plan.clustered_layers()} layer(s) clustered), vs HF "
              f"{hf / best['budgeted']:.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
