"""Task switching on one device: the time from a switch request to job B's first output, and
PipeSwitch's four-component breakdown (task cleaning, task initialization, memory allocation,
model transmission), for

(a) stop-and-start: the process of job A is terminated and a new process is started for B
    (imports torch and tidal, builds the model, allocates its weights, copies them from host
    memory, runs);
(b) one process that reloads: the same process drops A's model and builds, allocates and
    loads B's;
(c) tidal's switch (``tidal.runtime.switching.Switcher``): a standby worker, started ahead of
    time, becomes active; B's weights are carved from the arena and transmitted group by group
    from the shared host copy while the first groups compute; A is cleaned asynchronously.

Models: ResNet-152 and BERT-base (examples/models, batch 1, inference), grouped by the
``layer_groups`` pass (its ``optimal`` grouping, calibrated to this machine's host copy
bandwidth and forward speed). For (c) it also prints the pipelining ratio: B's first output
in the worker over (group 0's transfer + a resident forward); the goal is <= 1.2. ``--device``
picks the device (default ``cpu``; ``cuda`` on a GPU machine: the new process of (a) then
creates its CUDA context, as a restarted job does); figures are labelled with it.

``stop_and_start(ctx, job, host, device)`` and ``tidal_switch(sw, name)`` are what a harness
calls to compare one switch against a restart on any device with small models (``make
gpu-check``'s ``task_switch``). Every wait of a stop-and-start is bounded (``timeout_s``) and
ends early, with a ``SwitchingError`` naming the process and its exit code, when a spawned
process dies; job A's processes can be started ahead of time (``start_idle``), together, since
their start-up (spawn, imports) is not part of what is measured.

It then compares where a switch stops a *training* job A (ResNet-152-sized, batch 2) for an
inference job B: ``preempt_at="piece"`` (after the running piece, the unfinished iteration
rolled back) against ``"iteration"`` (at the end of the iteration): the wait until A stopped
and B's request -> first output, for requests at seeded random moments of A's iteration.

Run: ``.venv/bin/python benchmarks/switching.py`` (``--rounds 3 --preempt-rounds 5
--device cpu``).
"""
from __future__ import annotations

import argparse
import copy
import functools
import gc
import pickle
import queue
import random
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as tmp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tidal  # noqa: E402
from examples.models import ZOO  # noqa: E402
from tidal.ir import cost  # noqa: E402
from tidal.ir.table import format_table  # noqa: E402
from tidal.passes.layer_groups import LayerGroups  # noqa: E402
from tidal.runtime.switching import (HostModel, Repeat, SwitchingError,  # noqa: E402
                                     SwitchJob, Switcher)
from tidal.runtime.switching.device import enter_device, to_device  # noqa: E402
from tidal.runtime.switching.job import PortableGraph, weightless  # noqa: E402

MODELS = ("resnet152", "bert_base")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _same(out: torch.Tensor, expected: torch.Tensor, device: str) -> bool:
    """B's output (on the CPU) is the eager model's: bit for bit on the CPU, to float32
    rounding on a GPU (other kernels)."""
    if torch.device(device).type == "cpu":
        return torch.equal(out, expected)
    return torch.allclose(out.cpu(), expected.cpu(), rtol=1e-4, atol=1e-5)


def _copy_gbps(device: str = "cpu", nbytes: int = 256 << 20) -> float:
    """Host copy -> ``device`` bandwidth (from pinned memory on a GPU)."""
    dev = enter_device(device)
    src = torch.ones(nbytes, dtype=torch.uint8)
    src = src.pin_memory() if dev.type == "cuda" else src.share_memory_()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst.copy_(src)
    _sync(dev)
    t0 = time.perf_counter()
    dst.copy_(src)
    _sync(dev)
    return nbytes * 8 / 1e9 / (time.perf_counter() - t0)


def _job(name: str, gbps: float, device: str = "cpu") -> tuple[SwitchJob, torch.Tensor, float]:
    """Job ``name`` grouped for this machine (its forward timed on ``device``), its eager
    output (on the CPU) and forward seconds."""
    torch.manual_seed(0)
    model = ZOO[name]().eval()
    x = model.example_inputs(1)
    flops = cost.total_cost(tidal.compile(model, x).graph_module, 1)["fwd_flops"]
    dev = enter_device(device)
    on_device, xd = copy.deepcopy(model).to(dev), to_device(x, dev)
    with torch.no_grad():
        on_device(*xd)
        _sync(dev)
        t0 = time.perf_counter()
        expected = on_device(*xd)
        _sync(dev)
        fwd = time.perf_counter() - t0
    cluster = tidal.Cluster(gpus=1, bandwidth_gbps=gbps, latency_us=20.0,
                            peak_tflops=flops / fwd / 1e12)
    c = tidal.compile(model, x, cluster=cluster, passes=[LayerGroups(grouping="optimal")])
    groups = len(c.plan.get("layer_groups").groups)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          f"{groups} groups, forward {fwd * 1e3:.0f} ms ({dev})", file=sys.stderr, flush=True)
    return SwitchJob(name, c.graph_module, Repeat(x)), expected.cpu(), fwd


# (a) stop-and-start -------------------------------------------------------------------------
def _idle(ready) -> None:
    ready.set()
    time.sleep(3600)


def _wait_for(proc: Any, poll: Callable[[], Any], what: str, timeout_s: float) -> Any:
    """Call ``poll()`` (it waits briefly and returns a value, or None for nothing yet) until it
    gives a value; raise ``SwitchingError`` naming ``what`` as soon as ``proc`` has ended
    without one (after a last poll: what it sent before it exited) or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = poll()
        if got is not None:
            return got
        if not proc.is_alive():
            got = poll()
            if got is not None:
                return got
            raise SwitchingError(f"stop-and-start: {what}: process {proc.pid} ended (exit code "
                                 f"{proc.exitcode}) first")
        if time.monotonic() > deadline:
            raise SwitchingError(f"stop-and-start: {what}: nothing within {timeout_s:.0f} s "
                                 f"(process {proc.pid} is still running)")


def _get(q: Any, timeout_s: float = 0.05) -> Optional[tuple]:
    """The next item of ``q``, or None if none arrives within ``timeout_s``."""
    try:
        return q.get(timeout=timeout_s)
    except queue.Empty:
        return None


def _end(proc: Any, what: str, timeout_s: float = 30.0) -> None:
    """Join ``proc``; one still running after ``timeout_s`` is killed (with a warning: what
    it sent is valid, but a process that does not exit is a bug to look at)."""
    proc.join(timeout_s)
    if proc.is_alive():
        warnings.warn(f"stop-and-start: {what} (process {proc.pid}) did not exit within "
                      f"{timeout_s:.0f} s; killed", RuntimeWarning, stacklevel=2)
        proc.kill()
        proc.join(5)


def start_idle(ctx) -> tuple[Any, Any]:
    """Start job A's process for a stop-and-start (it only waits to be killed); returns the
    process and the event it sets once running. Start several at once, ahead of time: their
    start-up is not measured."""
    ready = ctx.Event()
    old = ctx.Process(target=_idle, args=(ready,), daemon=True)
    old.start()
    return old, ready


def wait_idle(old: tuple[Any, Any], timeout_s: float = 300.0) -> None:
    """Wait until job A's process ``old`` (from :func:`start_idle`) runs: at most
    ``timeout_s``; ``SwitchingError`` (the process killed) if it dies or does not start."""
    proc, ready = old
    try:
        _wait_for(proc, lambda: ready.wait(0.05) or None, "job A's process to start",
                  timeout_s)
    except SwitchingError:
        proc.kill()
        raise


def _cold(packed: bytes, host: HostModel, inputs, out, device: str = "cpu") -> None:
    entered = time.monotonic()
    dev = enter_device(device)  # a restarted job creates its device context
    gm = weightless(pickle.loads(packed).build())
    built = time.monotonic()
    tensors = dict(gm.named_parameters()) | dict(gm.named_buffers())
    views = host.tensors()
    fresh = {k: torch.empty(v.shape, dtype=v.dtype, device=dev) for k, v in views.items()}
    allocated = time.monotonic()
    for k, t in fresh.items():
        t.copy_(views[k])
        tensors[k].data = t
    _sync(dev)
    loaded = time.monotonic()
    with torch.no_grad():
        y = gm(*to_device(inputs, dev)).cpu()  # waits for the device
    out.put((entered, built, allocated, loaded, time.monotonic(), y.numpy()))  # no fd to share


def stop_and_start(ctx, job: SwitchJob, host: HostModel, device: str = "cpu",
                   old: Optional[tuple[Any, Any]] = None, timeout_s: float = 300.0) -> dict:
    """Job A's process (``old``, from :func:`start_idle`; None: one started here) is killed and
    a new process started for ``job`` on ``device`` (imports, device context, model,
    allocation, copy from ``host``, first forward): seconds of each part (``clean``, ``init``,
    ``alloc``, ``trans``), ``first`` (request -> first output) and ``out`` (B's output, on the
    CPU). Each wait takes at most ``timeout_s``; a process that dies fails it at once
    (``SwitchingError``)."""
    old = old if old is not None else start_idle(ctx)
    wait_idle(old, timeout_s)
    proc = old[0]
    out = ctx.Queue()
    packed = pickle.dumps(PortableGraph.of(weightless(job.graph)))
    t0 = time.monotonic()
    proc.kill()
    proc.join(timeout_s)
    cleaned = time.monotonic()
    new = ctx.Process(target=_cold, args=(packed, host, job.batches(0), out, device),
                      daemon=True)
    new.start()
    try:
        entered, built, allocated, loaded, done, y = _wait_for(
            new, lambda: _get(out), f"job {job.name!r}'s new process to give its output",
            timeout_s)
        first = time.monotonic() - t0
    except SwitchingError:
        new.kill()
        raise
    finally:
        _end(new, f"job {job.name!r}'s new process", min(30.0, timeout_s))
    return {"clean": cleaned - t0, "init": built - cleaned, "alloc": allocated - built,
            "trans": loaded - allocated, "first": first, "out": torch.from_numpy(y)}


# (b) one process that reloads ------------------------------------------------------------
def reload_in_process(job: SwitchJob, host: HostModel, previous: torch.nn.Module,
                      device: str = "cpu") -> dict:
    dev = enter_device(device)
    packed = pickle.dumps(PortableGraph.of(weightless(job.graph)))
    _sync(dev)
    t0 = time.perf_counter()
    for t in list(previous.parameters()) + list(previous.buffers()):
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    gc.collect()
    cleaned = time.perf_counter()
    gm = pickle.loads(packed).build()
    built = time.perf_counter()
    views = host.tensors()
    fresh = {k: torch.empty(v.shape, dtype=v.dtype, device=dev) for k, v in views.items()}
    allocated = time.perf_counter()
    tensors = dict(gm.named_parameters()) | dict(gm.named_buffers())
    for k, t in fresh.items():
        t.copy_(views[k])
        tensors[k].data = t
    _sync(dev)
    loaded = time.perf_counter()
    with torch.no_grad():
        y = gm(*to_device(job.batches(0), dev)).cpu()
    return {"clean": cleaned - t0, "init": built - cleaned, "alloc": allocated - built,
            "trans": loaded - allocated, "first": time.perf_counter() - t0, "out": y,
            "gm": gm}


# (c) tidal's switch -----------------------------------------------------------------------
def tidal_switch(sw: Switcher, name: str) -> dict:
    previous = sw.active.job if sw.active is not None else None
    s = sw.switch(name, iterations=2)
    outs = sw.wait()
    first, resident = outs[-2].result, outs[-1].result
    tl = first.timeline
    if previous is not None:
        sw.wait_saved(previous)  # for its cleaning time only
    t0 = tl.transfer[0][1] - tl.transfer[0][0]
    return {"clean": sw.states[previous].cleaning_s if previous else 0.0,
            "init": s.first_output_s - first.seconds - s.first.alloc_s,
            "alloc": s.first.alloc_s, "trans": sum(e - b for b, e in tl.transfer),
            "first": s.first_output_s, "out": s.output,
            "pipe": tl.first_output / (t0 + resident.seconds)}


# preemption: where the active job stops ----------------------------------------------------
def _train_job(name: str, preempt_at: str) -> SwitchJob:
    torch.manual_seed(0)
    model = ZOO[name]().train()
    x = model.example_inputs(2)
    with torch.no_grad():
        classes = model(*x).shape[-1]
    c = tidal.compile(model, x, passes=[LayerGroups()])
    target = torch.zeros(x[0].shape[0], dtype=torch.long) % classes
    return SwitchJob(f"{name}-train-{preempt_at}", c.graph_module, Repeat((x, target)),
                     torch.nn.functional.cross_entropy,
                     functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9),
                     preempt_at=preempt_at)


def preemption(name_a: str, name_b: str, rounds: int, seed: int,
               device: str = "cpu") -> list[list[str]]:
    """Training job A (``name_a``) runs; at a uniformly random moment of an iteration, a switch
    to inference job B (``name_b``) is asked. Per ``preempt_at``: A's iteration, the wait from
    the request until A stopped (its cleaning excluded) and B's request -> first output (A and
    B share the CPU until A stops)."""
    trains = {m: _train_job(name_a, m) for m in ("piece", "iteration")}
    infer, expected, _ = _job(name_b, _copy_gbps(device), device)
    rng = random.Random(seed)
    res: dict[str, list[tuple[float, float, float]]] = {m: [] for m in trains}
    with Switcher(list(trains.values()) + [infer], device, standby=1) as sw:
        for _ in range(rounds):
            for mode, job in trains.items():
                sw.switch(job.name)                # until preempted; returns at its first output
                seen = len(sw.states[job.name].outputs)
                sw.wait_output(job.name, seen + 1)  # a resident iteration, for its length
                iteration = sw.states[job.name].outputs[-1].result.seconds
                time.sleep(rng.uniform(0.0, iteration))
                b = sw.switch(infer.name, iterations=1)
                if not _same(b.output, expected, device):
                    raise AssertionError(f"{name_b}: output differs from the model")
                a = sw.wait_saved(job.name)
                sw.stop()
                res[mode].append((iteration, a.stop_s - a.cleaning_s, b.first_output_s))
    rows = []
    for mode, runs in res.items():
        med = [statistics.median(r[k] for r in runs) * 1e3 for k in range(3)]
        rows.append([f"{name_a} training, preempt_at={mode!r}", f"{med[0]:.0f}",
                     f"{med[1]:.0f}", f"{med[1] / med[0]:.2f}", f"{med[2]:.0f}"])
    return rows


def _switch_table(rounds: int, device: str = "cpu") -> None:
    """The switch request -> first output table of (a), (b), (c) for both models."""
    gbps = _copy_gbps(device)
    print(f"host copy bandwidth {gbps:.1f} Gb/s ({device})", file=sys.stderr, flush=True)
    jobs = {}
    for name in MODELS:
        jobs[name] = _job(name, gbps, device)
    hosts = {n: HostModel.of(j.graph) for n, (j, _, _) in jobs.items()}
    ctx = tmp.get_context("spawn")
    res = {(n, m): [] for n in MODELS for m in "abc"}
    with Switcher([j for j, _, _ in jobs.values()], device, standby=1) as sw:
        sw.switch(MODELS[-1], iterations=1)
        for _ in range(rounds):
            for name in MODELS:
                res[(name, "c")].append(tidal_switch(sw, name))
    previous = jobs[MODELS[-1]][0].graph
    for _ in range(rounds):
        for name in MODELS:
            res[(name, "a")].append(stop_and_start(ctx, jobs[name][0], hosts[name], device))
            r = reload_in_process(jobs[name][0], hosts[name], previous, device)
            previous = r.pop("gm")
            res[(name, "b")].append(r)
    labels = {"a": "(a) stop-and-start", "b": "(b) reload in one process",
              "c": "(c) tidal switch"}
    rows = []
    for name in MODELS:
        base = statistics.median(r["first"] for r in res[(name, "a")])
        ready = jobs[name][2]  # the forward of a ready model: overhead = first output - it
        base_over = base - ready
        for m in "abc":
            runs = res[(name, m)]
            for r in runs:
                if not _same(r["out"], jobs[name][1], device):
                    raise AssertionError(f"{name} {labels[m]}: output differs from the model")
            med = {k: statistics.median(r[k] for r in runs)
                   for k in ("clean", "init", "alloc", "trans", "first")}
            clean = f"{med['clean'] * 1e3:.1f}" + (" (async)" if m == "c" else "")
            pipe = f"{statistics.median(r['pipe'] for r in runs):.2f}" if m == "c" else "-"
            rows.append([name, labels[m], clean, f"{med['init'] * 1e3:.1f}",
                         f"{med['alloc'] * 1e3:.2f}", f"{med['trans'] * 1e3:.1f}",
                         f"{med['first'] * 1e3:.0f}", f"{med['first'] / base:.3f}",
                         f"{(med['first'] - ready) * 1e3:.0f}",
                         f"{(med['first'] - ready) / base_over:.3f}", pipe])
    print(f"{_label(device)} figures; medians of", rounds, "rounds, ms")
    print(format_table(["model", "mechanism", "task cleaning", "task init", "memory alloc",
                        "model transmission", "request -> first output", "vs (a)",
                        "overhead (- ready forward)", "overhead vs (a)",
                        "first output / (T0 + E)"], rows))
    print("ready forward (ms, in this process): " + ", ".join(
        f"{n} {jobs[n][2] * 1e3:.0f}" for n in MODELS))
    print("goals: (c) <= 0.050 of (a); first output / (group 0 transfer + forward) <= 1.2")


def _label(device: str) -> str:
    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (no GPU)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of the switch table (0: skip it)")
    ap.add_argument("--preempt-rounds", type=int, default=5,
                    help="rounds of the preemption comparison (0: skip it)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the preemption moments")
    ap.add_argument("--device", default="cpu", help="the device jobs run on (cpu, cuda)")
    args = ap.parse_args(argv)
    if args.rounds:
        _switch_table(args.rounds, args.device)
    if args.preempt_rounds:
        rows = preemption(MODELS[0], MODELS[1], args.preempt_rounds, args.seed, args.device)
        print(f"\npreemption ({_label(args.device)}; medians of {args.preempt_rounds} requests "
              "at seeded random moments of an iteration, ms)")
        print(format_table(["active job", "its iteration", "wait until it stopped",
                            "wait / iteration", f"{MODELS[1]} request -> first output"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
