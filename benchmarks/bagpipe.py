"""Bagpipe (dissertation ch. 5): iteration time and embedding bytes on the critical path of a
DLRM-style model trained on 2 trainers + 1 embedding server + the Oracle Cacher (processes on
this machine, gloo + TensorPipe), for

- no cache (every id fetched for its batch, every row synced and written back synchronously),
- a plain LRU cache (``--lru-rows`` rows per table, replicated: misses fetched and every cached
  row synced on the critical path),
- Bagpipe with lookahead 1, 5 and 20 (prefetch ahead, TTL caching, LRPP, delayed sync),

at Zipf alpha 0.5, 1.0 and 1.5, then the skew experiment of Fig. 5.17 (1 % of ids taking 90 %
of the accesses vs 1 % of them: no skew) for Bagpipe with lookahead 5. Every run of a table
shares one spawn of the processes; each row is the median over the iterations after the first
``--warmup`` (ms) and the mean bytes per iteration. The reference a user would otherwise pick,
TorchRec's ``EmbeddingBagCollection``, is tried first: its CPU build does not load against
this torch (the reason is printed).

CPU figures from one machine: the "network" is loopback RPC between processes, so the bytes
are the portable result and the times only show the trend; none is a GPU or cluster figure.

Run: ``.venv/bin/python benchmarks/bagpipe.py`` (``--iterations 30 --batch 512``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tidal  # noqa: E402
from examples.data.clicks import ClickData  # noqa: E402
from examples.models.recsys import CRITEO_NUM_DENSE, click_loss, dlrm  # noqa: E402
from tidal.ir.table import format_table  # noqa: E402
from tidal.passes.embedding_cache import EmbeddingCache  # noqa: E402
from tidal.runtime.bagpipe import RunSpec, train_many  # noqa: E402

PAPER = ("paper (8 p3.2xlarge trainers, Criteo Kaggle, batch 16K): Fig. 5.17 Bagpipe's iteration "
         "60.9 ms (1 % of ids take 90 % of accesses) -> 69.7 ms (no skew); LRPP + delayed sync "
         "cut the bytes on the critical path by ~70 % (§5.2.3)")


def torchrec_status() -> str:
    """Whether TorchRec's EmbeddingBagCollection runs here; if not, why."""
    try:
        from torchrec import EmbeddingBagCollection  # noqa: F401
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return (f"TorchRec is not usable here ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:100]}): installing torchrec 1.9.2 with "
                "fbgemm-gpu-cpu 1.9.0 was tried on 2026-11-24 and fbgemm_gpu's .so does not "
                "load against torch 2.13.0, so no TorchRec figure")
    return "TorchRec importable (not benchmarked by this script yet)"


def _rows(results, labels, warmup: int, base_label: str) -> list[list[str]]:
    base = None
    rows = []
    for label, res in zip(labels, results):
        stats = res.stats[warmup:] or res.stats
        ms = statistics.median(s.seconds for s in stats) * 1e3
        crit = sum(s.bytes_critical for s in stats) / len(stats)
        moved = sum(s.bytes_moved for s in stats) / len(stats)
        hit = sum(s.hits for s in stats) / max(1, sum(s.lookups for s in stats))
        if label == base_label:
            base = (ms, crit)
        rows.append([label, ms, crit, moved, hit])
    out = []
    for label, ms, crit, moved, hit in rows:
        out.append([label, f"{ms:.1f}", f"{ms / base[0]:.2f}", f"{crit / 1024:.0f}",
                    f"{crit / base[1]:.2f}" if base[1] else "-", f"{moved / 1024:.0f}",
                    f"{hit:.2f}"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="iterations left out of the medians")
    ap.add_argument("--batch", type=int, default=512, help="global batch (2 trainers)")
    ap.add_argument("--lru-rows", type=int, default=2048, help="LRU rows per table")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.5, 1.0, 1.5])
    ap.add_argument("--lookaheads", type=int, nargs="+", default=[1, 5, 20])
    args = ap.parse_args(argv)
    print(torchrec_status(), flush=True)
    model = dlrm()
    rows = model.table_rows
    probe = ClickData(CRITEO_NUM_DENSE, rows, args.batch)
    c = tidal.compile(model, probe.batch(0)[0], loss_fn=click_loss, passes=[EmbeddingCache()])
    plan = c.plan.get("embedding_cache")
    weights = {t.name: model.get_submodule(t.name).weight.detach() for t in plan.tables}
    compiled = (c.graph_module, plan, weights)
    header = ["run", "iteration ms", "vs no cache", "critical KiB/iter", "vs no cache",
              "moved KiB/iter", "hit rate"]
    specs, labels = [], []
    for alpha in args.alphas:
        data = ClickData(CRITEO_NUM_DENSE, rows, args.batch, alpha=alpha)
        runs = [("no cache", dict(policy="none")),
                (f"LRU {args.lru_rows} rows", dict(policy="lru", lru_rows=args.lru_rows))]
        runs += [(f"Bagpipe L={L}", dict(lookahead=L)) for L in args.lookaheads]
        for name, kw in runs:
            specs.append(RunSpec(compiled, data, args.iterations, lr=0.01, loss_fn=click_loss,
                                 **kw))
            labels.append((alpha, name))
    for share in (0.9, 0.01):
        data = ClickData(CRITEO_NUM_DENSE, rows, args.batch, hot_fraction=0.01, hot_share=share)
        for name, kw in (("no cache", dict(policy="none")), ("Bagpipe L=5", dict(lookahead=5))):
            specs.append(RunSpec(compiled, data, args.iterations, lr=0.01, loss_fn=click_loss,
                                 **kw))
            labels.append((f"1% of ids: {share:.0%} of accesses", name))
    print(f"dlrm: {len(plan.tables)} tables, {sum(rows):,} rows, {plan.nbytes / 2**20:.0f} MiB; "
          f"{len(specs)} runs of {args.iterations} iterations, batch {args.batch} on 2 trainers "
          "+ 1 server ...", flush=True)
    t0 = time.perf_counter()
    results = train_many(specs, trainers=2, servers=1, timeout_s=300)
    print(f"done in {time.perf_counter() - t0:.0f} s\n")
    groups: dict = {}
    for (group, name), res in zip(labels, results):
        groups.setdefault(group, []).append((name, res))
    for group, runs in groups.items():
        title = f"Zipf alpha {group}" if isinstance(group, float) else group
        print(f"{title} (CPU, loopback; medians over iterations {args.warmup}..)")
        print(format_table(header, _rows([r for _, r in runs], [n for n, _ in runs],
                                         args.warmup, "no cache")))
        print()
    print(PAPER)
    return 0


if __name__ == "__main__":
    sys.exit(main())
