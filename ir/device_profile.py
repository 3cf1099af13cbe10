"""Per-layer device profiles: measured forward/backward times keyed by a layer signature.

A :class:`DeviceProfile` maps a signature string to a :class:`LayerTime`. Two kinds of
signature exist:

* DeepPool-style keys from :func:`layer_signature`, which match the rows of the A100 profiles
  published with DeepPool (loaded by :meth:`DeviceProfile.from_deeppool`). The key is the one
  DeepPool's planner builds (``CostSim.getLayerIdentifier`` in ``parallelizationPlanner.py``)::

      kind + json.dumps(params, sort_keys=True, separators=(",", ":"))
           + "[" + str(per_gpu_batch) + "]"
           + json.dumps(input_dim, separators=(",", ":"))

  where ``input_dim`` excludes the batch and is a bare integer for 1-D inputs (``[64]25088``)
  and a JSON list otherwise (``[64][3,224,224]``).
* Generic keys from :func:`generic_signature` (module repr or function name, constant
  arguments, batch, input dtypes and shapes), used for profiles measured by
  :mod:`tidal.ir.profiler` for any node: :func:`node_signature` is the generic key of a node
  of a cost-annotated graph at a batch size (what the profiler measures and the cost model
  looks up).

Example:
    >>> import torch
    >>> from tidal.ir.device_profile import DeviceProfile, LayerTime, layer_signature
    >>> sig = layer_signature(torch.nn.Conv2d(3, 64, 3, padding=1), (3, 224, 224), 64)
    >>> sig
    'conv2d{"in_channels":3,"kernel_size":3,"out_channels":64,"padding":1,"stride":1}[64][3,224,224]'
    >>> prof = DeviceProfile("toy", {sig: LayerTime(2157.0, 6.0)})
    >>> prof.lookup(sig).total_us
    2163.0
    >>> DeviceProfile.from_json(prof.to_json()) == prof
    True
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_aggregate

from tidal.ir import meta
from tidal.ir.node_runner import COMPUTE_OPS

_JSON_FORMAT = "tidal.device_profile"
_JSON_VERSION = 1

# kind{params}[batch]input_dim, e.g. conv2d{"in_channels":3,...}[64][3,224,224] or linear{...}[64]4096
_DEEPPOOL_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\{.*\})\[(\d+)\](\S+)$")
_SUMMARY_PREFIXES = ("#", "SUM(avg)", "sum:")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@dataclass(frozen=True)
class LayerTime:
    """Forward and backward time of one layer, in microseconds."""

    fwd_us: float
    bwd_us: float

    def __post_init__(self) -> None:
        for name in ("fwd_us", "bwd_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"LayerTime({name}={value!r}): must be a number of microseconds")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"LayerTime({name}={value!r}): must be finite and >= 0")
            object.__setattr__(self, name, float(value))

    @property
    def total_us(self) -> float:
        """Forward plus backward time."""
        return self.fwd_us + self.bwd_us


class _FrozenEntries(Mapping):
    """A read-only, hashable ``str -> LayerTime`` mapping that keeps insertion order."""

    __slots__ = ("_data", "_hash")

    def __init__(self, items: Iterable[tuple[str, LayerTime]]):
        self._data = dict(items)
        self._hash: Optional[int] = None

    def __getitem__(self, key: str) -> LayerTime:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __repr__(self) -> str:
        return f"<{len(self._data)} entries>"


def _check_entries(entries: Any) -> _FrozenEntries:
    pairs = entries.items() if isinstance(entries, Mapping) else entries
    checked = []
    for item in pairs:
        key, value = item
        if not isinstance(key, str):
            raise TypeError(f"DeviceProfile(entries=...): signature {key!r} must be a str")
        if not isinstance(value, LayerTime):
            raise TypeError(
                f"DeviceProfile(entries=...): value for {key!r} must be a LayerTime, got "
                f"{type(value).__name__}"
            )
        checked.append((key, value))
    return _FrozenEntries(checked)


@dataclass(frozen=True)
class DeviceProfile:
    """Per-layer times of one device: ``signature -> LayerTime``.

    ``entries`` may be given as any mapping or iterable of ``(signature, LayerTime)`` pairs; it
    is stored as a read-only mapping, so profiles are immutable and hashable (a
    :class:`tidal.Cluster` holding one stays hashable).
    """

    name: str
    entries: Mapping[str, LayerTime] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"DeviceProfile(name={self.name!r}): name must be a str")
        object.__setattr__(self, "entries", _check_entries(self.entries))

    def __repr__(self) -> str:
        return f"DeviceProfile(name={self.name!r}, entries=<{len(self.entries)} entries>)"

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, signature: object) -> bool:
        return signature in self.entries

    def lookup(self, signature: str) -> Optional[LayerTime]:
        """The time recorded for ``signature``, or None."""
        return self.entries.get(signature)

    def merged(self, other: "DeviceProfile") -> "DeviceProfile":
        """A profile with the entries of both; ``other`` wins where both have a signature."""
        if not isinstance(other, DeviceProfile):
            raise TypeError(f"DeviceProfile.merged(other={other!r}): other must be a DeviceProfile")
        entries = dict(self.entries)
        entries.update(other.entries)
        name = self.name if self.name == other.name else f"{self.name}+{other.name}"
        return DeviceProfile(name, entries)

    def to_json(self) -> str:
        """JSON text that :meth:`from_json` turns back into an equal profile (floats exact)."""
        return json.dumps({
            "format": _JSON_FORMAT,
            "version": _JSON_VERSION,
            "name": self.name,
            "entries": {k: [v.fwd_us, v.bwd_us] for k, v in self.entries.items()},
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "DeviceProfile":
        """The profile written by :meth:`to_json`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"DeviceProfile.from_json: not JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != _JSON_FORMAT:
            raise ValueError(f"DeviceProfile.from_json: not a {_JSON_FORMAT} document")
        if data.get("version") != _JSON_VERSION:
            raise ValueError(
                f"DeviceProfile.from_json: version {data.get('version')!r} is not supported "
                f"(expected {_JSON_VERSION})"
            )
        raw = data.get("entries")
        if not isinstance(raw, dict) or not isinstance(data.get("name"), str):
            raise ValueError("DeviceProfile.from_json: 'name' must be a str, 'entries' an object")
        entries = {}
        for key, value in raw.items():
            if not (isinstance(value, list) and len(value) == 2):
                raise ValueError(
                    f"DeviceProfile.from_json: entry {key!r} must be [fwd_us, bwd_us], got {value!r}"
                )
            try:
                entries[key] = LayerTime(value[0], value[1])
            except (TypeError, ValueError) as e:
                raise ValueError(f"DeviceProfile.from_json: entry {key!r}: {e}") from None
        return cls(data["name"], entries)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write :meth:`to_json` to ``path`` (parent directories are created)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "DeviceProfile":
        """Read a profile written by :meth:`save`."""
        try:
            return cls.from_json(Path(path).read_text())
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_deeppool(cls, path: Union[str, os.PathLike], name: Optional[str] = None) -> "DeviceProfile":
        """Parse one of DeepPool's published per-layer profile files.

        Rows are ``key avg_ms ...`` with the key as :func:`layer_signature` builds it.

        * ``*.prof``: ``key avg_ms fwd_us bwd_us``. DeepPool's planner (``CostSim.loadGpuProfile``)
          reads the two integer columns as forward and backward microseconds, and so do we; the
          average column agrees with ``(fwd + bwd) / 1000`` up to the integer rounding of the
          columns (exact for Inception, up to ~17 % off for the smallest VGG/WRN rows).
        * ``*.txt`` (``#config avg(ms) p50 p90 p99``, the older format, also with only the
          average): only a total is known, split as ``fwd = total/3`` and ``bwd = 2*total/3``
          (backward taken as twice the forward).

        Blank lines, ``#`` comments/headers and ``SUM(avg)``/``sum:`` summary lines are skipped.
        A signature that occurs more than once keeps its last row, as in DeepPool's planner
        (a dict assignment). A malformed row raises ``ValueError`` naming the file and line.
        The profile is named ``deeppool:<file stem>`` unless ``name`` is given.
        """
        path = Path(path)
        if path.suffix == ".prof":
            numbers = (3,)
        elif path.suffix == ".txt":
            numbers = (1, 4)
        else:
            raise ValueError(f"DeviceProfile.from_deeppool({str(path)!r}): expected a .prof or .txt file")
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise ValueError(f"DeviceProfile.from_deeppool: cannot read {path}: {e}") from None
        entries: dict[str, LayerTime] = {}
        for lineno, line in enumerate(lines, 1):
            text = line.strip()
            if not text or text.startswith(_SUMMARY_PREFIXES):
                continue
            where = f"{path}:{lineno}"
            items = text.split()
            if len(items) - 1 not in numbers:
                raise ValueError(
                    f"{where}: expected a layer key and {' or '.join(map(str, numbers))} numbers, "
                    f"got {len(items)} fields: {text!r}"
                )
            _check_deeppool_key(items[0], where)
            try:
                values = [float(v) for v in items[1:]]
            except ValueError:
                raise ValueError(f"{where}: non-numeric time in {text!r}") from None
            try:
                if path.suffix == ".prof":
                    time = LayerTime(values[1], values[2])
                else:
                    total_us = values[0] * 1000.0
                    time = LayerTime(total_us / 3.0, 2.0 * total_us / 3.0)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            entries[items[0]] = time  # a repeated key keeps its last row, like DeepPool's dict
        return cls(name if name is not None else f"deeppool:{path.stem}", entries)


def _check_deeppool_key(key: str, where: str) -> None:
    match = _DEEPPOOL_KEY.match(key)
    if match is None:
        raise ValueError(f"{where}: {key!r} is not a DeepPool layer key kind{{params}}[batch]shape")
    try:
        params = json.loads(match.group(2))
        dims = json.loads(match.group(4))
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: bad JSON in layer key {key!r} ({e})") from None
    dims_ok = isinstance(dims, int) or (isinstance(dims, list) and all(isinstance(d, int) for d in dims))
    if not isinstance(params, dict) or not dims_ok:
        raise ValueError(f"{where}: layer key {key!r} needs a params object and an integer shape")


# --------------------------------------------------------------------------- signatures


def _pair(value: Any) -> Any:
    """DeepPool writes a square (k, k) argument as the int k and a (kh, kw) one as a list."""
    if isinstance(value, (tuple, list)):
        values = [int(v) for v in value]
        return values[0] if len(set(values)) == 1 else values
    return int(value)


def _deeppool_dims(input_shape: tuple[int, ...]) -> Any:
    return input_shape[0] if len(input_shape) == 1 else list(input_shape)


def _bottleneck_params(module: nn.Module) -> Optional[dict]:
    convs = [getattr(module, n, None) for n in ("conv1", "conv2", "conv3")]
    if not all(isinstance(c, nn.Conv2d) for c in convs):
        return None
    conv1, conv2, conv3 = convs
    expansion = int(getattr(module, "expansion", 4))
    planes = conv3.out_channels // expansion
    groups = conv2.groups
    width = conv2.in_channels
    if planes * expansion != conv3.out_channels or (width * 64) % (planes * groups):
        return None
    params: dict[str, Any] = {
        "inplanes": conv1.in_channels, "planes": planes, "groups": groups,
        "base_width": width * 64 // (planes * groups), "dilation": _pair(conv2.dilation),
    }
    downsample = getattr(module, "downsample", None)
    if downsample is not None:
        # DeepPool's first block of a stage also records stride and ((in, out, stride), bn_features)
        ds_conv = next((m for m in downsample.modules() if isinstance(m, nn.Conv2d)), None)
        if ds_conv is None:
            return None
        params["stride"] = _pair(conv2.stride)
        params["downsampleParams"] = [
            [ds_conv.in_channels, ds_conv.out_channels, _pair(ds_conv.stride)], ds_conv.out_channels
        ]
    return params


def _deeppool_kind(module: nn.Module, input_shape: tuple[int, ...]) -> Optional[tuple[str, dict]]:
    """DeepPool's layer name and params for ``module`` (see CostSim.Conv2d/.../GeneralLayer)."""
    if isinstance(module, nn.Conv2d):
        if (module.groups != 1 or _pair(module.dilation) != 1 or isinstance(module.padding, str)
                or module.padding_mode != "zeros"):
            return None  # DeepPool only profiled dense, undilated, zero-padded convolutions
        return "conv2d", {
            "in_channels": module.in_channels, "out_channels": module.out_channels,
            "kernel_size": _pair(module.kernel_size), "stride": _pair(module.stride),
            "padding": _pair(module.padding),
        }
    if isinstance(module, (nn.MaxPool2d, nn.AvgPool2d)):
        if isinstance(module, nn.MaxPool2d) and _pair(module.dilation) != 1:
            return None
        kind = "maxPool2d" if isinstance(module, nn.MaxPool2d) else "avgPool2d"
        return kind, {"kernel_size": _pair(module.kernel_size), "stride": _pair(module.stride),
                      "padding": _pair(module.padding)}
    if isinstance(module, nn.AdaptiveAvgPool2d):
        size = module.output_size
        size = (size, size) if isinstance(size, int) else tuple(size)
        if len(size) != 2 or any(s is None for s in size):
            return None
        return "adAvgPool2d", {"output_width": int(size[0]), "output_height": int(size[1])}
    if isinstance(module, nn.Linear):
        return "linear", {"in_features": module.in_features, "out_features": module.out_features,
                          "bias": module.bias is not None}
    if isinstance(module, nn.ReLU):
        # DeepPool names it after the previous layer: ReLU2d after conv/pool, ReLU1d after linear
        kind = {3: "ReLU2d", 1: "ReLU1d"}.get(len(input_shape), "ReLU")
        return kind, {"inplace": bool(module.inplace), "kernel_size": 1, "stride": 1, "padding": 0}
    if isinstance(module, nn.Flatten):
        if module.start_dim != 1 or module.end_dim != -1:
            return None
        return "flatten", {"kernel_size": 1}
    if isinstance(module, nn.Dropout):
        return "dropout", {"dropout": float(module.p)}
    if isinstance(module, nn.LayerNorm):
        shape = tuple(module.normalized_shape)
        return "layerNorm", {"dim": shape[0] if len(shape) == 1 else list(shape)}
    if type(module).__name__ == "Bottleneck":
        params = _bottleneck_params(module)
        return None if params is None else ("ResnetBottleneck", params)
    return None


def _check_shape(fn: str, arg: str, shape: Any) -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"{fn}({arg}={shape!r}): must be a tuple of non-negative ints")
    return tuple(shape)


def _check_batch(fn: str, batch: Any) -> int:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"{fn}(batch={batch!r}): must be a positive int")
    return batch


def layer_signature(module: nn.Module, input_shape: Sequence[int], batch: int) -> Optional[str]:
    """DeepPool's profile key for ``module`` at per-GPU ``batch`` on input ``input_shape``
    (without the batch dimension), or None for a kind DeepPool has no row for.

    Kinds: Conv2d (dense, undilated), MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, Linear, ReLU
    (``ReLU2d`` for a C,H,W input, ``ReLU1d`` for a flat one), Flatten, Dropout, LayerNorm and
    ResNet ``Bottleneck`` blocks (torchvision layout). BatchNorm and anything else give None.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"layer_signature(module={module!r}): must be a torch.nn.Module")
    shape = _check_shape("layer_signature", "input_shape", input_shape)
    batch = _check_batch("layer_signature", batch)
    found = _deeppool_kind(module, shape)
    if found is None:
        return None
    kind, params = found
    compact = (",", ":")
    return (kind + json.dumps(params, sort_keys=True, separators=compact) + f"[{batch}]"
            + json.dumps(_deeppool_dims(shape), separators=compact))


def _op_name(op: Any) -> str:
    if isinstance(op, nn.Module):
        text = " ".join(repr(op).split())
    elif isinstance(op, str):
        text = op
    elif callable(op):
        module = getattr(op, "__module__", None) or ""
        qualname = getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or repr(op)
        text = f"{module}.{qualname}" if module else qualname
    else:
        raise TypeError(
            f"generic_signature(op={op!r}): must be an nn.Module, a function name or a callable"
        )
    return _ADDRESS.sub("", text)


def _describe_input(item: Any) -> str:
    if item is None:
        return "-"
    if isinstance(item, meta.TensorInfo):
        shape, dtype = item.shape, item.dtype
    elif isinstance(item, torch.Tensor):
        shape, dtype = tuple(item.shape), item.dtype
    else:
        shape, dtype = _check_shape("generic_signature", "input_shapes[i]", item), None
    dtype_name = "?" if dtype is None else str(dtype).replace("torch.", "")
    return f"{dtype_name}[{','.join(str(d) for d in shape)}]"


def generic_signature(
    op: Union[nn.Module, str, Any],
    input_shapes: Sequence[Any],
    batch: int,
    *,
    args: Optional[str] = None,
) -> str:
    """A deterministic key for any op at ``batch``: ``op | args | B=batch | inputs``.

    ``op`` is a module (keyed by its whitespace-normalised repr), a function name, or a callable
    (keyed by ``module.qualname``); ``input_shapes`` lists each input as a ``TensorInfo``, a
    tensor, a shape tuple (dtype unknown: ``?``) or None (a non-tensor input); ``args`` an
    optional description of constant arguments. The key depends on nothing process-specific.

    >>> import torch
    >>> generic_signature(torch.nn.Linear(8, 4), [torch.zeros(2, 8)], 2)
    'Linear(in_features=8, out_features=4, bias=True) | - | B=2 | float32[2,8]'
    """
    batch = _check_batch("generic_signature", batch)
    if isinstance(input_shapes, (str, bytes)) or not isinstance(input_shapes, Sequence):
        raise ValueError(f"generic_signature(input_shapes={input_shapes!r}): must be a sequence")
    inputs = ",".join(_describe_input(item) for item in input_shapes)
    return " | ".join([_op_name(op), "-" if args is None else _ADDRESS.sub("", args),
                       f"B={batch}", inputs])


# ------------------------------------------------------------------ signatures of graph nodes


def _example_batch(gm: fx.GraphModule) -> int:
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            for t in meta.get_tensors(n):
                if len(t.shape) > 0:
                    return int(t.shape[0])
    raise ValueError(
        "node_signature: the graph's placeholders carry no annotated tensor shapes; run "
        "tidal.ir.cost.annotate(gm, example_inputs) first"
    )


def _batched_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose value is computed from a placeholder (and so scales with the batch)."""
    batched: set[fx.Node] = set()
    for n in gm.graph.nodes:  # fx graphs are topologically ordered
        if n.op == "placeholder" or any(a in batched for a in n.all_input_nodes):
            batched.add(n)
    return batched


def _format_arg(value: Any) -> str:
    if isinstance(value, fx.Node):
        return "T" if meta.get_tensors(value) else "?"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_format_arg(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={_format_arg(value[k])}" for k in sorted(value, key=str)) + "}"
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))


def node_signature(gm: fx.GraphModule, node: fx.Node, batch: int) -> str:
    """The :func:`generic_signature` of compute node ``node`` at ``batch``.

    Built from the annotated output tensors of the node's inputs (``tidal.ir.cost.annotate``
    records them at the example batch): dimension 0 of every input computed from a graph input
    is set to ``batch`` when it equals the example batch. Constant arguments are part of the
    key (``T`` marks a tensor input, ``?`` another node's non-tensor value).

    >>> import torch, torch.fx as fx
    >>> from tidal.ir import cost
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 4)))
    >>> cost.annotate(gm, (torch.randn(2, 8),))
    >>> lin = next(n for n in gm.graph.nodes if n.op == "call_module")
    >>> node_signature(gm, lin, 16)
    'Linear(in_features=8, out_features=4, bias=True) | (T) | B=16 | float32[16,8]'
    """
    if node.op not in COMPUTE_OPS:
        raise ValueError(
            f"node_signature(node={node.name!r}): op {node.op!r} is not a compute op {COMPUTE_OPS}"
        )
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"node_signature(batch={batch!r}): must be a positive int")
    return _signature(gm, node, batch, _example_batch(gm), _batched_nodes(gm))


def node_signatures(gm: fx.GraphModule, batch: int) -> dict[str, str]:
    """:func:`node_signature` of every compute node at ``batch``, by node name, analysing the
    graph once (rather than once per node)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"node_signatures(batch={batch!r}): must be a positive int")
    b0, batched = _example_batch(gm), _batched_nodes(gm)
    return {n.name: _signature(gm, n, batch, b0, batched)
            for n in gm.graph.nodes if n.op in COMPUTE_OPS}


def _signature(gm: fx.GraphModule, node: fx.Node, batch: int, b0: int,
               batched: set[fx.Node]) -> str:
    if node.op == "call_module":
        op: Any = gm.get_submodule(node.target)
    elif node.op == "call_method":
        op = f"Tensor.{node.target}"
    else:
        op = node.target
    inputs: list[Any] = []

    def visit(value: Any) -> Any:
        if isinstance(value, fx.Node):
            tensors = meta.get_tensors(value)
            if not tensors:
                inputs.append(None)
            for t in tensors:
                shape = tuple(t.shape)
                if value in batched and shape and shape[0] == b0:
                    shape = (batch,) + shape[1:]
                inputs.append(meta.TensorInfo(shape, t.dtype))
        return value

    map_aggregate((node.args, node.kwargs), visit)
    args = _format_arg(node.args)
    if node.kwargs:
        args += _format_arg(dict(node.kwargs))
    return generic_signature(op, inputs, batch, args=args)


DEEPPOOL_A100_LINK = (2.66e5 * 8 / 1e3, 40.0, 312.0)
"""DeepPool's published A100 planner setting, to go with :func:`deeppool_a100`: link Gb/s
(2.66e5 bytes/us), link latency us, and the A100's dense FP16 TFLOPS for layers without a row."""

DEEPPOOL_A100_ENV = "TIDAL_DEEPPOOL_PROFILES"
"""Environment variable naming the directory of DeepPool's A100 profiles."""


def deeppool_a100_dir() -> Path:
    """Where DeepPool's A100 profiles are looked for: ``$TIDAL_DEEPPOOL_PROFILES`` if set, else
    ``shared/data/deeppool-a100-profiles`` beside the repository (the project's data folder)."""
    env = os.environ.get(DEEPPOOL_A100_ENV)
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "deeppool-a100-profiles"


def deeppool_a100(directory: Union[str, os.PathLike, None] = None) -> DeviceProfile:
    """Every DeepPool A100 profile in ``directory`` (default :func:`deeppool_a100_dir`) as one
    profile named ``deeppool:a100``: the older ``*LayerGpuProfileA100*.txt`` files first, then
    the ``A100_*.prof`` files, so a ``.prof`` row wins over a ``.txt`` row with the same key.
    Raises ``FileNotFoundError`` naming the directory when it or its files are absent."""
    d = Path(directory).expanduser() if directory is not None else deeppool_a100_dir()
    files = sorted(d.glob("*LayerGpuProfileA100*.txt")) + sorted(d.glob("A100_*.prof")) \
        if d.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"DeepPool A100 profiles not found in {d} (expected A100_*.prof files; set "
            f"${DEEPPOOL_A100_ENV} to their directory)")
    entries: dict[str, LayerTime] = {}
    for f in files:
        entries.update(DeviceProfile.from_deeppool(f).entries)
    return DeviceProfile("deeppool:a100", entries)
