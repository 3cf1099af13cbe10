"""Wavelet on gloo ranks: tick_tock vs plain data parallelism, round_robin vs vanilla model
parallelism and GPipe-style micro-batching, plus the predicted peak-memory interleaving of
VGG-19 and BERT-base from the memory timeline.

Every throughput is samples/s measured in the same run, printed as a ratio to its baseline.
These are CPU numbers from gloo ranks sharing a few cores: they are NOT GPU ratios (the paper
reports up to 1.88x for data parallelism and 6.7x for model parallelism on V100s, where the
gains come from idle GPU memory and compute that a CPU run does not have).

    python benchmarks/wavelet.py                 # 4 ranks, the MLP chain, VGG-19 + BERT memory
    python benchmarks/wavelet.py --ranks 2 --steps 3 --no-memory
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tidal  # noqa: E402
from tidal.ir.schedule import split_batch  # noqa: E402
from tidal.passes.round_robin import RoundRobin  # noqa: E402
from tidal.passes.tick_tock import TickTock  # noqa: E402
from tidal.runtime.distributed import spawn  # noqa: E402


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _data(batch: int, width: int):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, width, generator=g),), torch.randint(0, 10, (batch,), generator=g)


def _opt(params):
    return torch.optim.SGD(params, lr=0.01)


def _timed(fn, steps: int) -> float:
    fn()  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    dist.barrier()
    return time.perf_counter() - t0


def _plain_dp(model, x, y, rank, world):
    opt = _opt(model.parameters())
    xs, ys = split_batch(x, world)[rank], split_batch(y, world)[rank]

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(*xs), ys).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)
        flat /= world
        o = 0
        for p in model.parameters():
            p.grad.copy_(flat[o:o + p.numel()].view_as(p))
            o += p.numel()
        opt.step()
    return step


def _pipeline(split, x, y, rank, world, micro):
    """Model parallelism on a chain split: rank p holds partition p; ``micro`` micro-batches
    fill and drain the pipeline (GPipe); micro = 1 is vanilla model parallelism."""
    stage = getattr(split, f"submod_{rank}")
    opt = _opt(stage.parameters())
    xs, ys = split_batch(x, micro), split_batch(y, micro)
    probe = x
    for p in range(rank):
        probe = getattr(split, f"submod_{p}")(*probe)
    shape = probe[0][: x[0].shape[0] // micro].shape

    def step():
        opt.zero_grad()
        saved = []
        for m in range(micro):
            if rank == 0:
                inp = xs[m][0]
            else:
                inp = torch.empty(shape)
                dist.recv(inp, rank - 1)
                inp.requires_grad_(True)
            out = stage(inp)[0]
            if rank < world - 1:
                dist.send(out.detach().contiguous(), rank + 1)
            saved.append((inp, out))
        for m in reversed(range(micro)):
            inp, out = saved[m]
            if rank == world - 1:
                (torch.nn.functional.cross_entropy(out, ys[m]) / micro).backward()
            else:
                g = torch.empty_like(out)
                dist.recv(g, rank + 1)
                out.backward(g)
            if rank > 0:
                dist.send(inp.grad.contiguous(), rank - 1)
        opt.step()
    return step


def _worker(rank, world, width, depth, batch, steps):
    x, y = _data(batch, width)
    out = {}
    model = _model(width, depth)
    out["data parallel"] = _timed(_plain_dp(model, x, y, rank, world), steps)
    model = _model(width, depth)
    tt = tidal.compile(model, x, passes=[TickTock(ranks=world)], example_targets=y,
                       loss_fn=torch.nn.functional.cross_entropy, optimizer=_opt)
    out["tick_tock"] = _timed(lambda: tt.step(x, y), steps)
    model = _model(width, depth)
    rr = tidal.compile(model, x, passes=[RoundRobin(partitions=world)],
                       loss_fn=torch.nn.functional.cross_entropy, optimizer=_opt)
    split = rr.graph_module
    out["vanilla model parallel"] = _timed(_pipeline(split, x, y, rank, world, 1), steps)
    out["GPipe-style (N micro-batches)"] = _timed(_pipeline(split, x, y, rank, world, world),
                                                  steps)
    out["round_robin"] = _timed(lambda: rr.step(x, y), steps)
    out["switch MiB/step"] = rr.plan.get("round_robin").switch_bytes_per_step() / 2 ** 20
    return out


def _memory_rows():
    from examples.models import ZOO
    from tidal.ir.capture import capture_train_step
    from tidal.ir.memory_timeline import interleave, memory_timeline

    rows = []
    for name, batch in (("vgg19", 2), ("bert_base", 2)):
        model = ZOO[name]().train()
        x, y = model.example_inputs(batch), model.example_targets(batch)
        tl = memory_timeline(capture_train_step(model, x, y, model.default_loss))
        il = interleave(tl, tl.forward_us)
        rows.append((name, batch, tl.saved_bytes, tl.peak_bytes, il.peak_sum, il.peak_gang,
                     tl.forward_us, tl.iteration_us))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-memory", action="store_true")
    args = ap.parse_args(argv)
    if args.ranks < 2:
        raise SystemExit(f"--ranks {args.ranks}: need at least 2")
    res = spawn(_worker, args.ranks, args.width, args.depth, args.batch, args.steps,
                timeout_s=1800)
    secs = {k: max(r[k] for r in res) for k in res[0] if k != "switch MiB/step"}
    sps = {k: args.batch * args.steps / v for k, v in secs.items()}
    print(f"wavelet on {args.ranks} gloo ranks (CPU): MLP {args.depth}x{args.width}, global "
          f"batch {args.batch}, {args.steps} timed steps. CPU ratios are not GPU ratios.")
    print(f"{'schedule':32s} {'samples/s':>10s} {'ratio':>7s}  baseline")
    for k, base in (("data parallel", "data parallel"), ("tick_tock", "data parallel"),
                    ("vanilla model parallel", "vanilla model parallel"),
                    ("GPipe-style (N micro-batches)", "vanilla model parallel"),
                    ("round_robin", "vanilla model parallel")):
        print(f"{k:32s} {sps[k]:10.1f} {sps[k] / sps[base]:7.2f}  {base}")
    rr_vs_gpipe = sps["round_robin"] / sps["GPipe-style (N micro-batches)"]
    print(f"round_robin / GPipe-style: {rr_vs_gpipe:.2f}; round_robin loads "
          f"{res[0]['switch MiB/step']:.3g} MiB of weights per rank per step (context switches)")
    if not args.no_memory:
        print("\npredicted activation memory (memory timeline, tock offset = forward time):")
        print(f"{'model':10s} {'batch':>5s} {'saved MiB':>9s} {'peak MiB':>9s} "
              f"{'tick+tock':>9s} {'gang 2x':>9s} {'ratio':>6s} {'fwd/iter':>8s}")
        mib = 2 ** 20
        for name, b, saved, peak, psum, pgang, fwd, it in _memory_rows():
            print(f"{name:10s} {b:5d} {saved / mib:9.1f} {peak / mib:9.1f} {psum / mib:9.1f} "
                  f"{pgang / mib:9.1f} {psum / pgang:6.2f} {fwd / it:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
