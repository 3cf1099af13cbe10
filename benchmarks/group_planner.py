"""Planner time for PipeSwitch's optimal grouping: tidal's exact algorithm vs Algorithm 1.

For ResNet-152, Inception-v3 and BERT-base (the zoo's full models) the layers are the graph's
module calls, each with the functional nodes after it (PipeSwitch also counts module calls:
464, 189 and 139 layers in its Table 5; our Inception-v3 has 4 more (2 max-pool, avg-pool,
dropout modules) and our BERT-base 14 more (12 GELU modules, classifier dropout and linear)).
Weight bytes come from the cost annotation, forward times from the FLOP count at a V100's
15.7 TFLOPS (batch 8), the link is PCIe 3.0 x16 (15.75 GB/s) with a 10 us per-transfer
overhead. Each solver runs in this process; the table prints both times beside Table 5 and
their ratio, and checks that they (and the (layer, groups) DP) reach the same finish time.
Algorithm 1 is stopped after ``--ref-calls`` recursive calls (it is exponential on these
costs in Python).

Run: ``.venv/bin/python benchmarks/group_planner.py`` (add ``--no-reference`` to skip the
reference search).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the zoo, examples.models, imports from a checkout
    sys.path.insert(0, str(ROOT))

import tidal  # noqa: E402
from tidal.ir.table import format_table  # noqa: E402
from examples.models import bert_base, inception_v3, resnet152
from tidal.passes.group_planner import (SearchBudgetExceeded, dp_grouping, optimal_grouping,
                                        pipeswitch_search)
from tidal.passes.layer_groups import LayerGroups

PCIE3_X16_GBPS = 126.0  # 15.75 GB/s
TABLE5_S = {"resnet152": (464, 1.33), "inception_v3": (189, 0.18), "bert_base": (139, 0.34)}


def _best_time(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-reference", action="store_true", help="skip Algorithm 1")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ref-calls", type=int, default=300_000,
                    help="stop Algorithm 1 after this many recursive calls")
    args = ap.parse_args(argv)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))
    cluster = tidal.Cluster(gpus=1, bandwidth_gbps=PCIE3_X16_GBPS, latency_us=10.0,
                            peak_tflops=15.7)
    rows = []
    for name, factory in (("resnet152", resnet152), ("inception_v3", inception_v3),
                          ("bert_base", bert_base)):
        model = factory().eval()
        c = tidal.compile(model, model.example_inputs(args.batch), cluster=cluster,
                          passes=[LayerGroups()])
        plan = c.plan.get("layer_groups")
        kw = dict(bytes_per_us=plan.bytes_per_us, overhead_us=plan.overhead_us)
        fast_s, fast = _best_time(lambda: optimal_grouping(plan.layer_bytes, plan.layer_exec_us,
                                                           **kw), 5)
        dp_s, dp = _best_time(lambda: dp_grouping(plan.layer_bytes, plan.layer_exec_us, **kw), 3)
        ref_s, ref, ref_txt = float("nan"), None, "-"
        if not args.no_reference:
            t0 = time.perf_counter()
            try:
                ref = pipeswitch_search(plan.layer_bytes, plan.layer_exec_us,
                                        max_calls=args.ref_calls, **kw)
                ref_s = time.perf_counter() - t0
                ref_txt = f"{ref_s * 1e3:.1f}"
            except SearchBudgetExceeded:
                ref_s = time.perf_counter() - t0
                ref_txt = f"> {ref_s * 1e3:.0f} (stopped)"
        layers, paper_s = TABLE5_S[name]
        same = [abs(g.time_us - fast.time_us) <= 1e-9 * fast.time_us
                for g in (dp, ref) if g is not None]
        agree = f"{'yes' if all(same) else 'NO'} ({'fast, DP, Alg.1' if ref else 'fast, DP'})"
        rows.append([name, f"{len(plan.layers)} ({layers})", len(fast.groups),
                     f"{fast.time_us / 1e3:.2f}", f"{plan.single_group_us / 1e3:.2f}",
                     f"{plan.per_layer_us / 1e3:.2f}", f"{fast_s * 1e3:.2f}", f"{dp_s * 1e3:.1f}",
                     ref_txt, f"{paper_s * 1e3:.0f}", f"{fast_s / paper_s:.4f}",
                     f"{'> ' if ref is None else ''}{ref_s / fast_s:.0f}x", agree])
        print(f"{name}: done", file=sys.stderr, flush=True)
    print(format_table(["model", "layers (paper)", "groups", "opt ms", "1 group ms",
                        "per-layer ms", "fast ms", "DP ms", "Alg.1 ms", "Table 5 ms", "fast/Table 5",
                        "Alg.1/fast", "same optimum"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
