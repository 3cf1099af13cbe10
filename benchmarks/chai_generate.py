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
"""
from __future__ import annotations

import argparse
import dataclasses
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
from tidal.runtime.chai_decode import ChaiDecoder  # noqa: E402
from tidal.runtime.smollm2 import load_smollm2  # noqa: E402


def _ttnt_generate(target, ids: torch.Tensor, new: int, **kw) -> tuple[float, object]:
    """Mean seconds per token after the first of one greedy ``target.generate(ids, **kw)``,
    and its output."""
    clock = _Clock()
    with torch.inference_mode():
        out = target.generate(ids, streamer=clock, do_sample=False, pad_token_id=0,
                              max_new_tokens=1 + new, min_new_tokens=1 + new,
                              return_dict_in_generate=True, **kw)
    return (clock.times[-1] - clock.times[1]) / (len(clock.times) - 2), out


def _ttnt_side(dec: ChaiDecoder, ids: torch.Tensor, new: int) -> float:
    """Mean seconds per greedy step of the side decoder after its prefill."""
    with torch.inference_mode():
        logits, state = dec.prefill(ids, ids.shape[1] + new + 1, last_only=True)
        tok = logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(new):
            tok = dec.step(tok, state)[:, -1:].argmax(-1)
        return (time.perf_counter() - t0) / new


def _k_bytes(cache) -> int:
    return sum(k.numel() * k.element_size() for k in cache.key_cache)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model, tok = load_smollm2("sdpa")
    calib_ids = tok(calibration_text(), return_tensors="pt").input_ids[0]
    eval_ids = tok(evaluation_text(), return_tensors="pt").input_ids[0]
    evals = _chunks(eval_ids, args.chunk_len, args.eval_chunks)
    print(f"# SmolLM2-135M-Instruct (GGUF Q4_1 dequantised, fp32, sdpa), CPU, "
          f"{torch.get_num_threads()} thread(s); greedy, {args.new_tokens} timed tokens")
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
            t, out = _ttnt_generate(model, ids, args.new_tokens, past_key_values=cache)
            best["HF generate (DynamicCache)"] = min(best["HF generate (DynamicCache)"], t)
            kbytes["HF generate (DynamicCache)"] = _k_bytes(cache)
            del out, cache
            for name, compiled in variants.items():
                cache = compiled.new_cache()
                t, out = _ttnt_generate(compiled, ids, args.new_tokens, past_key_values=cache)
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
