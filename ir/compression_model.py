"""Gradient compressors as data: the spec grammar, the levels, the bytes sent and the performance
model's view of a compressor. Pure Python (no torch): what a pass needs at planning time.

A compressor is named by a *spec* ``name[:level][,option=value...]``:

* ``name``: ``powersgd``, ``topk``, ``randomk``, ``signsgd``, ``qsgd`` or ``none`` (plain
  averaging all-reduce, the sync SGD baseline);
* ``level``: the knob Accordion turns: PowerSGD's rank (an integer >= 1), Top-K's and random-K's
  fraction K/n in (0, 1], QSGD's levels s (an integer in [1, 32767]); signSGD and ``none`` have
  none. Left out, the compressor's default (rank 4, 1 %, 4 levels);
* ``option=value``: a keyword option of the compressor: ``seed``, ``error_feedback``
  (``true``/``false``) and PowerSGD's ``min_compression_rate`` and ``warm_start``. A spec
  names everything a compressor is built from, so ``str(spec)`` (which writes the level and
  the options that differ from the defaults) rebuilds the same compressor.

The ``compression`` pass validates specs and levels (:func:`parse_spec`, :func:`check_level`),
counts the bytes sent (:meth:`CompressorSpec.payload_bytes`) and prices a compressor
(:func:`compressor_cost`) from here; the runtime compressors (:mod:`tidal.runtime.comm.compressors`)
are built from the same specs and answer ``check_level``, ``payload_bytes`` and ``spec()``
through these functions, so a plan's byte counts are the bytes the runtime sends.

Example:
    >>> from tidal.ir.compression_model import compressor_cost, parse_spec
    >>> s = parse_spec("powersgd:2,min_compression_rate=0")
    >>> s.name, s.level, s.option("min_compression_rate"), str(s)
    ('powersgd', 2, 0.0, 'powersgd:2,min_compression_rate=0')
    >>> s.payload_bytes((64, 32)), s.payload_bytes((64,))   # (n + m) r floats; 1-d: as is
    (768, 256)
    >>> str(parse_spec("TopK")), parse_spec("topk:0.1").payload_bytes((100,))  # values + indices
    ('topk:0.01', 80)
    >>> cost = compressor_cost("powersgd:4", [[(256, 512), (512,)]], encode_decode_s=0.01)
    >>> cost.payload_bytes, cost.rounds, cost.all_reduce   # per round: (256+512)*4*4/2 + 512*4/2
    ((7168.0,), 2, True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

from tidal.ir.perf_model import CompressorCost

Shape = tuple[int, ...]


@dataclass(frozen=True)
class CompressorKind:
    """What is fixed for a compressor name: the class name used in messages, the level's
    noun (None: no level), its default, all-reduce compatibility, collective rounds per step,
    and the keyword options with their defaults (in the order a spec writes them)."""

    name: str
    title: str
    level_noun: Optional[str]
    default_level: Any
    all_reduce: bool
    rounds: int
    options: tuple[tuple[str, Any], ...]

    @property
    def defaults(self) -> dict[str, Any]:
        """Option name -> default value."""
        return dict(self.options)


_SEED = ("seed", 0)
KINDS: Mapping[str, CompressorKind] = MappingProxyType({k.name: k for k in (
    CompressorKind("powersgd", "PowerSGD", "rank", 4, True, 2,
                   (("min_compression_rate", 2.0), ("error_feedback", True),
                    ("warm_start", True), _SEED)),
    CompressorKind("topk", "TopK", "fraction", 0.01, False, 1,
                   (("error_feedback", True), _SEED)),
    CompressorKind("randomk", "RandomK", "fraction", 0.01, True, 1,
                   (("error_feedback", True), _SEED)),
    CompressorKind("signsgd", "SignSGD", None, None, False, 1,
                   (("error_feedback", False), _SEED)),
    CompressorKind("qsgd", "QSGD", "levels", 4, False, 1, (("error_feedback", False), _SEED)),
    CompressorKind("none", "NoCompression", None, None, True, 1, (_SEED,)),
)})
"""The compressors by name."""

QSGD_MAX_LEVELS = 32767


def kind(name: str) -> CompressorKind:
    """The :class:`CompressorKind` of ``name``; ``ValueError`` naming an unknown one."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown compressor {name!r} (known: {', '.join(KINDS)})") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_level(name: str, level: Any) -> Any:
    """``level`` validated for compressor ``name`` (a fraction comes back as a float);
    ``ValueError`` naming it when it is out of range or the compressor has no level."""
    k = kind(name)
    if k.level_noun == "rank":
        if not _is_int(level) or level < 1:
            raise ValueError(f"PowerSGD rank {level!r}: must be an integer >= 1")
        return level
    if k.level_noun == "fraction":
        if not isinstance(level, (int, float)) or isinstance(level, bool) or not 0 < level <= 1:
            raise ValueError(f"{k.title} fraction {level!r}: K must be a fraction in (0, 1]")
        return float(level)
    if k.level_noun == "levels":
        if not _is_int(level) or not 1 <= level <= QSGD_MAX_LEVELS:
            raise ValueError(f"QSGD levels {level!r}: must be an integer in "
                             f"[1, {QSGD_MAX_LEVELS}]")
        return level
    raise ValueError(f"compressor {name!r} has no compression level to set (got {level!r})")


def as_level(name: str, value: Any) -> Any:
    """A level read back as a number (a JSON float like ``4.0`` for a PowerSGD rank), in the
    type :func:`check_level` wants."""
    if kind(name).level_noun in ("rank", "levels") and isinstance(value, float) \
            and value.is_integer():
        value = int(value)
    return check_level(name, value)


def check_option(name: str, key: str, value: Any) -> Any:
    """Keyword option ``key`` of compressor ``name`` validated (a rate comes back as a float);
    ``ValueError`` naming an unknown option or a bad value."""
    k = kind(name)
    defaults = k.defaults
    if key not in defaults:
        raise ValueError(f"compressor {name!r} has no option {key!r} "
                         f"(options: {', '.join(defaults)})")
    default = defaults[key]
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{k.title}({key}={value!r}): must be true or false")
        return value
    if _is_int(default):
        if not _is_int(value):
            raise ValueError(f"{k.title}({key}={value!r}): must be an integer")
        return value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"{k.title}({key}={value!r}): must be >= 0")
    return float(value)


def _number_text(value: Any) -> str:
    """The shortest text that reads back as ``value`` (``0.01``, ``4``, ``true``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = f"{value:g}"
    return text if float(text) == value else repr(value)


@dataclass(frozen=True)
class CompressorSpec:
    """A parsed spec: ``name``, ``level`` (the default filled in; None for a compressor with no
    level) and ``options``, the keyword options that differ from the defaults. Build one with
    :func:`parse_spec` or :meth:`of`; ``str()`` gives the canonical spec text."""

    name: str
    level: Any = None
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, name: str, level: Any = None, **options: Any) -> "CompressorSpec":
        """A validated spec from a name, a level (None: the default) and keyword options."""
        k = kind(name)
        if level is None:
            level = k.default_level
        elif k.level_noun is None:
            raise ValueError(f"compressor {name!r} takes no level (got {level!r})")
        level = None if k.level_noun is None else check_level(name, level)
        checked = {key: check_option(name, key, v) for key, v in options.items()}
        return cls(name, level, tuple((key, checked[key]) for key, default in k.options
                                      if key in checked and checked[key] != default))

    @property
    def kind(self) -> CompressorKind:
        return kind(self.name)

    @property
    def all_reduce_compatible(self) -> bool:
        """Whether its collectives are sums (all-reduce); else it needs all-gather."""
        return self.kind.all_reduce

    @property
    def rounds(self) -> int:
        """Collective rounds per step (PowerSGD: 2, P then Q)."""
        return self.kind.rounds

    def option(self, key: str) -> Any:
        """The value of keyword option ``key`` (its default unless the spec sets it)."""
        defaults = self.kind.defaults
        if key not in defaults:
            check_option(self.name, key, None)       # raises, naming the options
        return dict(self.options).get(key, defaults[key])

    def payload_bytes(self, shape: Shape, level: Any = None) -> int:
        """Bytes one rank sends per step for a gradient of ``shape`` (at ``level``; default
        the spec's), summed over rounds."""
        return payload_bytes(self.name, shape, self.level if level is None else level,
                             dict(self.options))

    def uncompressed(self, shape: Shape, level: Any = None) -> bool:
        """Whether a gradient of ``shape`` is sent as is."""
        return uncompressed(self.name, shape, self.level if level is None else level,
                            dict(self.options))

    def __str__(self) -> str:
        text = self.name if self.level is None else f"{self.name}:{_number_text(self.level)}"
        return "".join([text] + [f",{k}={_number_text(v)}" for k, v in self.options])


def parse_spec(spec: str) -> CompressorSpec:
    """``"powersgd:4"``, ``"topk:0.01"``, ``"signsgd"``, ``"qsgd:8,seed=3"`` -> a
    :class:`CompressorSpec`; ``ValueError`` naming an unknown compressor, a level that is not a
    number or out of range, or a bad option."""
    if not isinstance(spec, str):
        raise TypeError(f"a compressor spec is a string like 'powersgd:4', got "
                        f"{type(spec).__name__}")
    head, *rest = spec.strip().split(",")
    name, colon, level_text = head.partition(":")
    name = name.strip().lower()
    if name not in KINDS:
        raise ValueError(f"unknown compressor {name!r} in {spec!r} "
                         f"(known: {', '.join(KINDS)})")
    k = KINDS[name]
    level: Any = None
    level_text = level_text.strip()
    if colon and k.level_noun is None:
        raise ValueError(f"compressor spec {spec!r}: {name} takes no level")
    if level_text:
        try:
            level = float(level_text) if k.level_noun == "fraction" else int(level_text)
        except ValueError:
            raise ValueError(f"compressor spec {spec!r}: level {level_text!r} is not a "
                             "number") from None
    options: dict[str, Any] = {}
    for item in rest:
        key, eq, text = (part.strip() for part in item.partition("="))
        if not eq or key not in k.defaults:
            raise ValueError(f"compressor spec {spec!r}: {item.strip()!r} is not an option of "
                             f"{name} (options: {', '.join(k.defaults)}, as key=value)")
        options[key] = _option_value(spec, key, text, k.defaults[key])
    return CompressorSpec.of(name, level, **options)


def _option_value(spec: str, key: str, text: str, default: Any) -> Any:
    """The value of option ``key`` from its text, in the type of its default."""
    try:
        if isinstance(default, bool):
            return {"true": True, "false": False, "1": True, "0": False}[text.lower()]
        return int(text) if _is_int(default) else float(text)
    except (KeyError, ValueError):
        raise ValueError(f"compressor spec {spec!r}: {key}={text!r} is not "
                         f"{'true or false' if isinstance(default, bool) else 'a number'}"
                         ) from None


@runtime_checkable
class HasSpec(Protocol):
    """Anything that names a compressor by a spec string (a runtime compressor)."""

    def spec(self) -> str: ...


SpecLike = Union[str, CompressorSpec, HasSpec]


def as_spec(compressor: SpecLike) -> CompressorSpec:
    """A :class:`CompressorSpec` from a spec string, a spec, or anything with ``.spec()``."""
    if isinstance(compressor, CompressorSpec):
        return compressor
    if isinstance(compressor, str):
        return parse_spec(compressor)
    if isinstance(compressor, HasSpec):
        return parse_spec(compressor.spec())
    raise TypeError(f"a compressor must be a spec string like 'powersgd:4' (or have a "
                    f".spec() giving one), got {type(compressor).__name__}")


# -- sizes -------------------------------------------------------------------------------------

def matrix_dims(shape: Shape) -> tuple[int, int]:
    """``(n, m)`` of the matrix view of a tensor: the first dim by the product of the rest."""
    return shape[0], math.prod(shape[1:])


def powersgd_rank(shape: Shape, rank: int) -> int:
    """The rank PowerSGD uses on a matrix of ``shape``: at most ``n`` and ``m``."""
    n, m = matrix_dims(shape)
    return min(rank, n, m)


def sparse_k(numel: int, fraction: float) -> int:
    """How many of ``numel`` coordinates Top-K/random-K keep: ``ceil(fraction numel)``, at
    least 1."""
    return max(1, min(numel, math.ceil(fraction * numel)))


def qsgd_value_bytes(levels: int) -> int:
    """Bytes of one QSGD level on the wire: int8 up to 127 levels, else int16."""
    return 1 if levels <= 127 else 2


def _options(name: str, options: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    return {**kind(name).defaults, **(options or {})}


def uncompressed(name: str, shape: Shape, level: Any,
                 options: Optional[Mapping[str, Any]] = None) -> bool:
    """Whether compressor ``name`` at ``level`` sends a gradient of ``shape`` as is: always for
    ``none``; for PowerSGD a 1-d tensor, or a matrix whose compression rate
    ``n m / ((n + m) r)`` is below ``min_compression_rate``."""
    if name == "none":
        return True
    if name != "powersgd":
        return False
    if len(shape) < 2:
        return True
    n, m = matrix_dims(shape)
    rate = _options(name, options)["min_compression_rate"]
    return n * m < rate * (n + m) * powersgd_rank(shape, level)


def payload_bytes(name: str, shape: Shape, level: Any,
                  options: Optional[Mapping[str, Any]] = None) -> int:
    """Bytes one rank sends per step for a gradient of ``shape`` through compressor ``name`` at
    ``level`` with keyword ``options`` (defaults for those left out), summed over rounds.
    Gradients go on the wire as float32; ``none`` counts 4 bytes an element too."""
    numel = math.prod(shape)
    if uncompressed(name, shape, level, options):
        return 4 * numel
    if name == "powersgd":
        n, m = matrix_dims(shape)
        return 4 * (n + m) * powersgd_rank(shape, level)
    if name == "topk":
        return 8 * sparse_k(numel, level)         # float32 values + int32 indices
    if name == "randomk":
        return 4 * sparse_k(numel, level)         # values only: the indices are shared
    if name == "signsgd":
        return (numel + 7) // 8 + (4 if _options(name, options)["error_feedback"] else 0)
    if name == "qsgd":
        return 4 + numel * qsgd_value_bytes(level)   # the norm + one level per element
    raise ValueError(f"unknown compressor {name!r} (known: {', '.join(KINDS)})")


def compressor_cost(compressor: SpecLike, bucket_shapes: Sequence[Sequence[Shape]],
                    encode_decode_s: float) -> CompressorCost:
    """The performance model's view of ``compressor`` (a spec, or anything with ``.spec()``)
    on buckets of gradient shapes: the payload of each bucket split evenly over the rounds."""
    spec = as_spec(compressor)
    payload = tuple(sum(spec.payload_bytes(tuple(s)) for s in b) / spec.rounds
                    for b in bucket_shapes)
    return CompressorCost(str(spec), payload, float(encode_decode_s), spec.all_reduce_compatible,
                          spec.rounds)
