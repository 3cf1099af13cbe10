"""Pipelined weight loading: group ``k+1``'s weights stream in while group ``k`` computes.

A graph grouped by the ``layer_groups`` pass has a ``tidal::group_boundary(k)`` marker before
the first node of each group. :func:`group_tensors` reads the groups back from the markers (a
parameter or buffer belongs to the group of its first use). :func:`write_groups` writes the
current weights as a grouped store (:mod:`tidal.runtime.weight_store`). :class:`WeightLoader`
copies each group's contiguous buffer from the memory-mapped store to the device on its own
thread (a side CUDA stream on a GPU), checks the bytes against the store's per-tensor checksums
(one pass over the copy; a corrupt tensor raises ``WeightStoreError`` naming it and its group),
rebinds the group's parameters and buffers to views of the copy, and sets a per-group event;
the boundary op waits on that event through :func:`tidal.ir.ops.loading`. It records when
each transfer ran and when each group executed.

Example:
    >>> import os, tempfile, torch, tidal
    >>> from tidal.passes.layer_groups import LayerGroups
    >>> from tidal.runtime.weight_loader import write_groups, run_pipelined
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> x = torch.randn(3, 4)
    >>> c = tidal.compile(model.eval(), (x,), passes=[LayerGroups(grouping="per_layer")])
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> write_groups(c.graph_module, path)
    >>> expected = model(x)
    >>> with torch.no_grad():
    ...     _ = [p.zero_() for p in model.parameters()]
    >>> out, tl = run_pipelined(c.graph_module, path, (x,))
    >>> torch.equal(out, expected), len(tl.transfer)
    (True, 3)
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from tidal.ir import ops
from tidal.runtime.weight_store import (PathLike, TensorSpec, WeightStore, WeightStoreError,
                                        view_tensor, write_store)

GroupedTensors = list[list[tuple[str, torch.Tensor]]]


def group_tensors(gm: fx.GraphModule) -> GroupedTensors:
    """The parameters and buffers of each layer group, from the graph's ``group_boundary``
    markers: each tensor goes to the group of the first node that uses it; tensors no node
    uses go to the last group. Raises ``ValueError`` for a graph without markers."""
    named: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        named.setdefault(id(t), (name, t))
    groups: GroupedTensors = []
    assigned: set[int] = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is ops.GROUP_BOUNDARY:
            if n.args[0] != len(groups):
                raise ValueError(f"group_boundary node {n.name} has group {n.args[0]}, "
                                 f"expected {len(groups)} (markers out of order)")
            groups.append([])
            continue
        if n.op == "call_module":
            mod = gm.get_submodule(n.target)
            used = list(mod.parameters()) + list(mod.buffers())
        elif n.op == "get_attr":
            obj = gm
            for part in str(n.target).split("."):
                obj = getattr(obj, part)
            used = [obj] if isinstance(obj, torch.Tensor) else []
        else:
            continue
        fresh = [t for t in used if id(t) in named and id(t) not in assigned]
        if fresh and not groups:
            raise ValueError(f"node {n.name} uses weights before the first group_boundary")
        for t in fresh:
            groups[-1].append(named[id(t)])
            assigned.add(id(t))
    if not groups:
        raise ValueError("the graph has no tidal::group_boundary markers: run the "
                         "layer_groups pass first")
    groups[-1].extend(v for k, v in named.items() if k not in assigned)
    return groups


def expected_specs(groups: GroupedTensors) -> list[list[TensorSpec]]:
    """What a store for ``groups`` must hold: names, shapes and dtypes, group by group."""
    return [[TensorSpec.of(name, t) for name, t in g] for g in groups]


def write_groups(gm: fx.GraphModule, path: PathLike) -> None:
    """Write the graph module's current weights to ``path`` in its layer groups."""
    write_store(path, group_tensors(gm))


@dataclass(frozen=True)
class LoadTimeline:
    """Recorded times in seconds from the start of loading: per group the ``transfer``
    (start, end) and the ``execute`` (start, end) interval, and when the output was ready."""

    transfer: tuple[tuple[float, float], ...]
    execute: tuple[tuple[float, float], ...]
    first_output: float

    def overlaps(self) -> bool:
        """True if group 0 started executing before the last transfer ended."""
        return self.execute[0][0] < self.transfer[-1][1]


class WeightLoader:
    """Streams a store's groups into the model's tensors on a background thread.

    ``targets`` are the model's tensors group by group (from :func:`group_tensors`). ``wait(k)``
    blocks until group ``k`` is resident. ``link_bytes_per_us``/``link_overhead_us`` emulate
    a slower link (each transfer takes at least ``overhead + bytes / bandwidth``), for tests.
    """

    def __init__(self, store: WeightStore, targets: GroupedTensors,
                 device: Optional[torch.device] = None,
                 link_bytes_per_us: Optional[float] = None, link_overhead_us: float = 0.0):
        if link_bytes_per_us is not None and not link_bytes_per_us > 0:
            raise ValueError(f"link_bytes_per_us={link_bytes_per_us!r}: must be > 0")
        self.store = store
        self.targets = targets
        self.device = torch.device(device or "cpu")
        self.link = (link_bytes_per_us, link_overhead_us)
        n = store.num_groups
        self._ready = [threading.Event() for _ in range(n)]
        self._cuda_events: list[Any] = [None] * n
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self.t0 = 0.0
        self.transfer: list[tuple[float, float]] = [(0.0, 0.0)] * n
        self.waits: list[tuple[float, float]] = [(0.0, 0.0)] * n

    def start(self) -> "WeightLoader":
        """Start streaming on a background thread."""
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="tidal-weight-loader",
                                        daemon=True)
        self._thread.start()
        return self

    def _copy_group(self, k: int) -> torch.Tensor:
        """Group ``k``'s bytes on the device, checked against the store's checksums before
        they are returned (on a GPU the check reads the pinned staging copy while the
        transfer runs)."""
        region = self.store.group_region(k)
        if self.device.type == "cuda":  # pinned staging + side stream; not measured here
            stream = self._stream = getattr(self, "_stream", None) or torch.cuda.Stream(self.device)
            staging = region.pin_memory()
            with torch.cuda.stream(stream):
                dst = torch.empty(region.numel(), dtype=torch.uint8, device=self.device)
                dst.copy_(staging, non_blocking=True)
                self._cuda_events[k] = torch.cuda.Event()
                self._cuda_events[k].record(stream)
            self.store.verify(k, staging)
            return dst
        dst = torch.empty(region.numel(), dtype=torch.uint8, device=self.device)
        dst.copy_(region)
        # the checksum is computed on the host: verify the source bytes off the CPU
        self.store.verify(k, dst if dst.device.type == "cpu" else region)
        return dst

    def _run(self) -> None:
        try:
            for k in range(self.store.num_groups):
                start = time.perf_counter()
                buf = self._copy_group(k)
                for (spec, offset), (name, target) in zip(self.store.group_tensors(k),
                                                          self.targets[k]):
                    target.data = view_tensor(buf, spec, offset)
                bw, oh = self.link
                if bw is not None:
                    rest = start + (oh + buf.numel() / bw) * 1e-6 - time.perf_counter()
                    if rest > 0:
                        time.sleep(rest)
                self.transfer[k] = (start - self.t0, time.perf_counter() - self.t0)
                self._ready[k].set()
        except BaseException as e:  # surfaced by wait() in the executing thread
            self._error = e
        finally:
            for ev in self._ready:
                ev.set()

    def wait(self, group: int) -> None:
        """Block until ``group``'s weights are resident (re-raises a loading error)."""
        called = time.perf_counter()
        self._ready[group].wait()
        self._raise_error(f"loading weight group {group}")
        if self._cuda_events[group] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._cuda_events[group])
        self.waits[group] = (called - self.t0, time.perf_counter() - self.t0)

    def join(self) -> None:
        """Wait for the loader thread to finish (re-raises a loading error)."""
        if self._thread is not None:
            self._thread.join()
        self._raise_error("loading weights")

    def _raise_error(self, what: str) -> None:
        """Re-raise the loader thread's error, if any: a ``WeightStoreError`` (a corrupt
        tensor) as one, anything else as a ``RuntimeError``."""
        if self._error is None:
            return
        if isinstance(self._error, WeightStoreError):  # it names the store already
            raise WeightStoreError(f"{what} failed: {self._error}") from self._error
        raise RuntimeError(f"{what} from {self.store.path} failed: {self._error}") \
            from self._error

    def timeline(self, output_time: float) -> LoadTimeline:
        """The recorded timeline, given when (``perf_counter``) the output was ready."""
        end = output_time - self.t0
        starts = [w[1] for w in self.waits]
        ends = [w[0] for w in self.waits[1:]] + [end]
        return LoadTimeline(tuple(self.transfer), tuple(zip(starts, ends)), end)


def run_pipelined(gm: fx.GraphModule, path: PathLike, inputs: Sequence[Any],
                  kwargs: Optional[dict] = None, *, device: Optional[torch.device] = None,
                  link_bytes_per_us: Optional[float] = None, link_overhead_us: float = 0.0
                  ) -> tuple[Any, LoadTimeline]:
    """Run ``gm`` while its weights stream in from the store at ``path``; return the output
    and the recorded timeline. The store is validated before anything runs."""
    targets = group_tensors(gm)
    store = WeightStore.open(path, expected_specs(targets))
    try:
        loader = WeightLoader(store, targets, device, link_bytes_per_us, link_overhead_us)
        with torch.no_grad(), ops.loading(loader):
            loader.start()
            try:
                out = gm(*inputs, **(kwargs or {}))
                done = time.perf_counter()
            finally:
                loader.join()
        return out, loader.timeline(done)
    finally:
        store.close()


def cold_start(compiled: Any, path: PathLike, *inputs: Any, **kwargs: Any) -> Any:
    """The first output of a compiled model whose weights stream in from ``path`` (the
    ``layer_groups`` pass must have run). Inputs default to the compile-time example inputs."""
    if not inputs and not kwargs:
        inputs = compiled.context.example_inputs
    out, _ = run_pipelined(compiled.graph_module, path, inputs, kwargs)
    return out


def from_plan(gm: fx.GraphModule, plan: Any) -> Optional["PipelinedLoadExecutor"]:
    """The executor of a ``layer_groups`` plan that names a weight store (None without one:
    the graph runs as it is)."""
    store = getattr(plan, "weight_store", None)
    return PipelinedLoadExecutor(store) if store else None


class PipelinedLoadExecutor:
    """Executor for ``Compiled``: the first forward streams the weights in from ``path`` while
    it runs; later calls (and training steps) run the resident graph."""

    def __init__(self, path: PathLike):
        self.path = path
        self.loaded = False
        self.last_timeline: Optional[LoadTimeline] = None

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        if self.loaded:
            return gm(*args, **kwargs)
        out, self.last_timeline = run_pipelined(gm, self.path, args, kwargs)
        self.loaded = True
        return out

    def _load_all(self, gm: fx.GraphModule) -> None:
        targets = group_tensors(gm)
        with WeightStore.open(self.path, expected_specs(targets)) as store:
            loader = WeightLoader(store, targets).start()
            loader.join()
        self.loaded = True

    def step(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        if not self.loaded:
            self._load_all(gm)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(gm(*inputs), targets)
        loss.backward()
        optimizer.step()
        return loss.detach()
