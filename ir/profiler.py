"""Measured per-node forward/backward times on a real device, cached on disk.

:func:`profile_layers` runs every compute node of a traced graph by itself (through
:func:`tidal.ir.node_runner.run_isolated`) at each requested batch size, times its forward and
its backward (median of ``repeats`` runs after ``warmup``), and returns a
:class:`~tidal.ir.device_profile.DeviceProfile` keyed by :func:`node_signature`. Results are cached
as one JSON file per (signature set, device name, torch version) under ``cache_dir`` (default
``$TIDAL_CACHE_DIR``, else ``~/.cache/tidal/profiles``), so a second call with the same graph,
batches and device measures nothing.

A node timed by itself misses what the whole pass adds (allocator and cache state, autograd
bookkeeping, the loss). :func:`time_training_step` measures one whole training step of the
graph on one process, and :func:`calibrate_profile` scales a profile's entries at one batch so
that they add up to such a measurement (an in-context calibration, taken on one process,
independent of any multi-rank run it is later used to predict).

Example:
    >>> import tempfile, torch, torch.fx as fx
    >>> from tidal.ir.profiler import node_signature, profile_layers
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
    >>> prof = profile_layers(gm, (torch.randn(4, 8),), [2, 4], repeats=2, warmup=1,
    ...                       cache_dir=tempfile.mkdtemp(), progress=False)
    >>> lin = next(n for n in gm.graph.nodes if n.op == "call_module")
    >>> node_signature(gm, lin, 2)
    'Linear(in_features=8, out_features=8, bias=True) | (T) | B=2 | float32[2,8]'
    >>> prof.lookup(node_signature(gm, lin, 2)).fwd_us > 0
    True
"""
from __future__ import annotations

import copy
import hashlib
import os
import platform
import re
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map
from tqdm import tqdm

from tidal.ir import meta
from tidal.ir.cost import annotate
from tidal.ir.device_profile import DeviceProfile, LayerTime, node_signature, node_signatures
from tidal.ir.node_runner import COMPUTE_OPS, run_isolated

__all__ = ["default_cache_dir", "device_name", "node_signature", "node_signatures",
           "profile_layers", "StepTime", "time_training_step", "training_step_samples",
           "calibrate_profile"]


def default_cache_dir() -> Path:
    """``$TIDAL_CACHE_DIR`` if set, else ``~/.cache/tidal/profiles``."""
    env = os.environ.get("TIDAL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tidal" / "profiles"


# --------------------------------------------------------------------------- measuring


class _Timer:
    """Wall time of a ``with`` block in microseconds, synchronising the device around it."""

    def __init__(self, sync: Callable[[], None]):
        self._sync = sync
        self._start = 0
        self.us = 0.0

    def __enter__(self) -> "_Timer":
        self._sync()
        self._start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sync()
        self.us = (time.perf_counter_ns() - self._start) / 1000.0


def _device_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def device_name(device: Union[str, torch.device]) -> str:
    """A name for the cache key: the GPU model on CUDA, ``cpu-<machine>`` on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"cpu-{platform.machine() or 'unknown'}"
    return device.type


def _rebatch_real(value: Any, batch: int, device: torch.device) -> Any:
    """A random tensor like ``value`` with dim 0 set to ``batch``; integers stay in range."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0:
        return value.to(device)
    shape = (batch,) + tuple(value.shape[1:])
    if value.dtype == torch.bool:
        return torch.rand(shape, device=device) < 0.5
    if value.is_floating_point() or value.is_complex():
        return torch.randn(shape, dtype=value.dtype, device=device)
    if value.numel() == 0:
        return torch.zeros(shape, dtype=value.dtype, device=device)
    low = min(0, int(value.min()))
    high = int(value.max()) + 1
    return torch.randint(low, high, shape, dtype=value.dtype, device=device)


class _TimingInterpreter(fx.Interpreter):
    """Runs a graph node by node, timing each compute node whose signature is still unmeasured."""

    def __init__(self, gm, signatures, results, warmup, repeats, sync, bar):
        super().__init__(gm, garbage_collect_values=True)
        self.signatures = signatures  # node name -> signature at this batch
        self.results = results
        self.warmup, self.repeats, self.sync, self.bar = warmup, repeats, sync, bar

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in COMPUTE_OPS:
            return super().run_node(n)
        sig = self.signatures[n.name]
        if sig in self.results:
            out = run_isolated(self, n)
        else:
            for _ in range(self.warmup):
                run_isolated(self, n, _Timer(self.sync), _Timer(self.sync))
            fwd, bwd = [], []
            for _ in range(self.repeats):
                tf, tb = _Timer(self.sync), _Timer(self.sync)
                out = run_isolated(self, n, tf, tb)
                fwd.append(tf.us)
                bwd.append(tb.us)
            self.results[sig] = LayerTime(statistics.median(fwd), statistics.median(bwd))
        self.bar.update(1)
        return out


def _cache_path(cache_dir: Path, signatures: Iterable[str], device: str) -> Path:
    digest = hashlib.sha256("\n".join(sorted(set(signatures))).encode()).hexdigest()[:24]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{device}-torch{torch.__version__}")
    return cache_dir / f"profile-{digest}-{slug}.json"


def _load_cached(path: Path, wanted: set[str]) -> Optional[DeviceProfile]:
    if not path.is_file():
        return None
    try:
        cached = DeviceProfile.load(path)
    except (OSError, ValueError) as e:
        warnings.warn(f"profile_layers: ignoring unreadable cache file {path}: {e}")
        return None
    return cached if wanted.issubset(cached.entries) else None


def profile_layers(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    batch_sizes: Iterable[int],
    *,
    device: Union[str, torch.device] = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    cache_dir: Union[str, os.PathLike, None] = None,
    progress: bool = True,
) -> DeviceProfile:
    """Measure every compute node's forward and backward time at each batch size on ``device``.

    ``example_inputs`` are re-batched along dimension 0 as fresh random tensors of the same
    dtype (integer inputs such as token ids are drawn from ``[0, max]`` of the example). ``gm``
    is annotated with ``tidal.ir.cost.annotate`` if it is not yet, and run as a copy on
    ``device`` (its own parameters and buffers are untouched). Entries are keyed by
    :func:`node_signature`; a node whose signature was already measured at that batch (a
    repeated layer) is measured once. A tqdm bar over nodes x batches goes to stderr unless
    ``progress=False``. The result is cached on disk (see the module docstring) and loaded
    from there, without measuring, when every signature is already present.
    """
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"profile_layers(gm={type(gm).__name__}): must be a torch.fx.GraphModule")
    batches = list(batch_sizes)
    if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches):
        raise ValueError(f"profile_layers(batch_sizes={batches!r}): must be positive ints")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"profile_layers(repeats={repeats!r}): must be an int >= 1")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"profile_layers(warmup={warmup!r}): must be an int >= 0")
    device = torch.device(device)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not any(meta.get_tensors(n) for n in placeholders):
        annotate(gm, example_inputs)
    nodes = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    signatures = {b: node_signatures(gm, b) for b in batches}
    wanted = {s for per_batch in signatures.values() for s in per_batch.values()}
    name = device_name(device)
    path = _cache_path(Path(cache_dir) if cache_dir is not None else default_cache_dir(), wanted, name)
    cached = _load_cached(path, wanted)
    if cached is not None:
        return cached

    work = copy.deepcopy(gm).to(device)
    sync = _device_sync(device)
    results: dict[str, LayerTime] = {}
    with tqdm(total=len(nodes) * len(batches), desc="profiling layers", unit="node",
              file=sys.stderr, disable=not progress) as bar:
        for b in batches:
            inputs = tree_map(lambda v: _rebatch_real(v, b, device), tuple(example_inputs))
            _TimingInterpreter(work, signatures[b], results, warmup, repeats, sync, bar).run(*inputs)
    profile = DeviceProfile(f"measured:{name}", {s: results[s] for s in sorted(results)})
    try:
        profile.save(path)
    except OSError as e:
        warnings.warn(f"profile_layers: could not write the cache file {path}: {e}")
    return profile


# --------------------------------------------------------------------------- in context


_STATS = {"median": statistics.median, "min": min}


@dataclass(frozen=True)
class StepTime:
    """One measured training step: forward + loss + backward (``fwd_bwd_us``) and the optimizer
    step (``update_us``), in microseconds."""

    fwd_bwd_us: float
    update_us: float


def training_step_samples(gm: fx.GraphModule, inputs: Sequence[Any], targets: Any,
                          loss_fn: Callable[[Any, Any], torch.Tensor], *, repeats: int = 5,
                          warmup: int = 2, lr: float = 0.01,
                          before_each: Optional[Callable[[], Any]] = None
                          ) -> tuple[list[float], list[float]]:
    """Per run, the time (us) of a whole training step of a copy of ``gm`` on ``inputs``
    (zero_grad, forward, ``loss_fn(outputs, targets)``, backward) and, separately, of its SGD
    step: two lists of ``repeats`` samples after ``warmup`` runs. ``before_each`` is called
    before every run, outside the timed region (e.g. ``torch.distributed.barrier``, so that
    processes timing at once start each step together). ``gm`` itself is untouched."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"training step timing: repeats={repeats!r} must be an int >= 1")
    work = copy.deepcopy(gm)
    opt = torch.optim.SGD(work.parameters(), lr=lr)
    fb, up = [], []
    for i in range(warmup + repeats):
        if before_each is not None:
            before_each()
        t0 = time.perf_counter_ns()
        opt.zero_grad(set_to_none=False)
        loss_fn(work(*inputs), targets).backward()
        t1 = time.perf_counter_ns()
        opt.step()
        t2 = time.perf_counter_ns()
        if i >= warmup:
            fb.append((t1 - t0) / 1000.0)
            up.append((t2 - t1) / 1000.0)
    return fb, up


def time_training_step(gm: fx.GraphModule, inputs: Sequence[Any], targets: Any,
                       loss_fn: Callable[[Any, Any], torch.Tensor], *, repeats: int = 5,
                       warmup: int = 2, lr: float = 0.01, stat: str = "median") -> StepTime:
    """Time of a whole training step of a copy of ``gm`` on ``inputs`` on this process
    (zero_grad, forward, ``loss_fn(outputs, targets)``, backward; then an SGD step timed
    separately): the ``stat`` (``"median"`` or ``"min"``, the estimator least disturbed by
    other processes) of ``repeats`` runs after ``warmup`` (:func:`training_step_samples`).
    ``gm`` itself is untouched."""
    if stat not in _STATS:
        raise ValueError(f"time_training_step(stat={stat!r}): use one of {tuple(_STATS)}")
    fb, up = training_step_samples(gm, inputs, targets, loss_fn, repeats=repeats,
                                   warmup=warmup, lr=lr)
    return StepTime(_STATS[stat](fb), _STATS[stat](up))


def calibrate_profile(profile: DeviceProfile, gm: fx.GraphModule, batch: int,
                      total_us: float) -> DeviceProfile:
    """``profile`` with the entries of ``gm``'s compute nodes at ``batch`` scaled by one factor
    so that the nodes' forward + backward times add up to ``total_us`` (e.g. the
    ``fwd_bwd_us`` of :func:`time_training_step` at that batch). Other entries are kept.
    Raises ``ValueError`` when the profile has none of the nodes or ``total_us`` <= 0."""
    if not total_us > 0:
        raise ValueError(f"calibrate_profile(total_us={total_us!r}): must be > 0")
    sigs = node_signatures(gm, batch)
    counted = [profile.lookup(s) for s in sigs.values()]
    known = [t for t in counted if t is not None]
    if not known:
        raise ValueError(f"calibrate_profile: profile {profile.name!r} has no entry for the "
                         f"graph's nodes at batch {batch}")
    factor = total_us / sum(t.total_us for t in known)
    entries = dict(profile.entries)
    for s in set(sigs.values()):
        t = profile.lookup(s)
        if t is not None:
            entries[s] = LayerTime(t.fwd_us * factor, t.bwd_us * factor)
    return DeviceProfile(profile.name, entries)
