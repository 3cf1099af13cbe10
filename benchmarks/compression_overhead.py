"""Encode+decode time of each compressor on ResNet-50's gradients, on this machine (one process,
no communication), next to the dissertation's Table 4.1 (ms on a V100, for reference only).

The gradients are random tensors of ResNet-50's 161 parameter shapes (25.6 M floats). Each
compressor's median time over ``--repeats`` runs is printed with its ratio to PowerSGD rank 4
(measured in the same process) and its compression ratio; the last column compares the order of
the methods with Table 4.1's.

    python benchmarks/compression_overhead.py [--repeats 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.models import ZOO  # noqa: E402
from tidal.ir.perf_model import PAPER_TABLE_4_1_MS  # noqa: E402
from tidal.runtime.comm.compressors import make_compressor  # noqa: E402
from tidal.runtime.comm.compressors.modeling import measure_encode_decode_s  # noqa: E402

# (spec here, Table 4.1 row)
METHODS = (("powersgd:4", "PowerSGD-Rank4"), ("topk:0.01", "TopK-1%"),
           ("randomk:0.01", "RandomK-1%"), ("signsgd", "SignSGD"), ("qsgd:1", "QSGD-2bit"),
           ("none", None))


def resnet50_shapes() -> list[tuple[int, ...]]:
    """ResNet-50's parameter shapes (built on the meta device)."""
    with torch.device("meta"):
        model = ZOO["resnet50"]()
    return [tuple(p.shape) for p in model.parameters()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = resnet50_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    rows = []
    for spec, paper in METHODS:
        c = make_compressor(spec)
        sec = measure_encode_decode_s(c, shapes, repeats=args.repeats)
        payload = sum(c.payload_bytes(s) for s in shapes)
        rows.append((spec, sec * 1e3, 4 * numel / payload,
                     PAPER_TABLE_4_1_MS[paper][0] if paper else None,
                     c.all_reduce_compatible))
    base = rows[0][1]
    ranked = [r[0] for r in sorted((r for r in rows if r[3] is not None), key=lambda r: r[1])]
    paper_ranked = [r[0] for r in sorted((r for r in rows if r[3] is not None),
                                         key=lambda r: r[3])]
    print(f"ResNet-50 gradients: {len(shapes)} tensors, {numel / 1e6:.1f} M floats; "
          f"{args.threads} thread(s), median of {args.repeats}")
    print(f"{'compressor':<14}{'ms here':>10}{'/ powersgd:4':>14}{'ratio':>9}{'all-reduce':>12}"
          f"{'Table 4.1 ms (V100)':>21}")
    for spec, ms, ratio, paper_ms, ar in rows:
        print(f"{spec:<14}{ms:>10.1f}{ms / base:>14.2f}{ratio:>8.1f}x{('yes' if ar else 'no'):>12}"
              f"{(f'{paper_ms:.0f}' if paper_ms else '-'):>21}")
    print(f"order here (fastest first):  {' < '.join(ranked)}")
    print(f"order in Table 4.1:          {' < '.join(paper_ranked)}")


if __name__ == "__main__":
    main()
