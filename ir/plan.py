"""Plans: frozen dataclasses that say what a pass decided, with an exact JSON round trip.

A plan saved with ``to_json()`` is replayed with ``Plan.from_json()`` (no search). The JSON
names the plan's *kind*, a registered name (the class name, or the class's own ``plan_kind``
attribute), never a module path: ``Plan.from_json`` looks the kind up in :data:`PLANS`, the
registry of plan kinds (``tidal.ir.registry.Registry``), and imports nothing a plan names, so a
crafted plan cannot run an import. Its rows are the plan kinds the passes emit, each in a fixed
module of ``tidal.ir.plans`` (imported, all of them, the first time a kind is looked up); a plan
class defined anywhere else (a user's pass, a test) is registered by being defined: the registry
also holds every subclass of :class:`Plan`. JSON written by older versions
(``"module:QualName"``) is read by its ``QualName`` when that names a registered plan class; the
module part is only compared, never imported. Fields are decoded by their type annotations, so
tuples come back as tuples and nested dataclasses as dataclasses.

Example:
    >>> from dataclasses import dataclass
    >>> from tidal.ir.plan import Plan, plan_kind
    >>> @dataclass(frozen=True)
    ... class Toy(Plan):
    ...     gpus: tuple[int, ...]
    ...     time_us: float
    >>> Toy((1, 2), 3.5).to_json() == Toy.from_json(Toy((1, 2), 3.5).to_json()).to_json()
    True
    >>> plan_kind(Toy)
    'Toy'
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import types
import typing
from typing import Any, ClassVar, Iterable, Iterator, Optional

from tidal.ir.errors import PlanError
from tidal.ir.registry import Entry, Registry


def plan_kind(cls: type) -> str:
    """The registered kind name of plan class ``cls``: its own ``plan_kind`` class attribute
    (not an inherited one) or else its class name."""
    return cls.__dict__.get("plan_kind") or cls.__name__


def _defined_plans() -> Iterator[tuple[str, type]]:
    """(kind, class) of ``Plan`` and its subclasses, recursively, oldest first: the plan
    classes registered by being defined (their kind read now)."""
    def walk(cls: type) -> Iterator[type]:
        yield cls
        for sub in cls.__subclasses__():
            yield from walk(sub)
    return ((plan_kind(c), c) for c in dict.fromkeys(walk(Plan)))


PLANS: Registry[type] = Registry("plan kind", (
    Entry("BurstPlan", "tidal.ir.plans.burst:BurstPlan"),
    Entry("TickTockPlan", "tidal.ir.plans.tick_tock:TickTockPlan"),
    Entry("RoundRobinPlan", "tidal.ir.plans.round_robin:RoundRobinPlan"),
    Entry("CompressionPlan", "tidal.ir.plans.compression:CompressionPlan"),
    Entry("LayerGroupPlan", "tidal.ir.plans.layer_groups:LayerGroupPlan"),
    Entry("ChaiPlan", "tidal.ir.plans.chai:ChaiPlan"),
    Entry("EmbeddingCachePlan", "tidal.ir.plans.embedding_cache:EmbeddingCachePlan"),
), defined=_defined_plans)
"""The registry of plan kinds: the kinds the passes emit (the plans they hold, such as
``Schedule``, ``MemoryFit``, are defined by their modules' imports), then every other defined
subclass of :class:`Plan`."""


def plan_classes() -> tuple[type, ...]:
    """Every registered plan class (the rows of :data:`PLANS`, imported, then every other
    defined subclass of ``Plan``, oldest first)."""
    return tuple(dict.fromkeys(cls for _, cls in PLANS.items()))


def _identity(cls: type) -> tuple[str, str]:
    return cls.__module__, cls.__qualname__


def _unique(candidates: list[type], kind: str) -> type:
    """The one class among ``candidates`` (a class redefined under the same module and name,
    as by re-running a cell or a test, resolves to its newest definition)."""
    identities = list(dict.fromkeys(_identity(c) for c in candidates))
    if len(identities) > 1:
        where = ", ".join(f"{m}.{q}" for m, q in identities)
        raise PlanError(f"plan kind {kind!r} is ambiguous: it names the plan classes {where}; "
                        f"give one of them its own plan_kind class attribute")
    return candidates[-1]


def _class_of(kind: Any, expected: type) -> type:
    """The registered plan class of ``kind`` (``expected`` and its subclasses first). Looks the
    name up among :func:`plan_classes`; imports nothing."""
    if not isinstance(kind, str):
        raise PlanError(f"plan kind {shown(kind)} is not a string")
    classes = plan_classes()
    module, legacy, qualname = kind.rpartition(":")
    if legacy:  # written by an older tidal as "module:QualName": match the QualName only
        found = [c for c in classes if c.__qualname__ == qualname]
        found = [c for c in found if c.__module__ == module] or found
    else:
        found = [c for c in classes if plan_kind(c) == kind]
    if not found:
        known = ", ".join(sorted({plan_kind(c) for c in classes}))
        raise PlanError(f"unknown plan kind {shown(kind)}: no registered plan class has that name "
                        f"(plan kinds are looked up, never imported, so there is no importable "
                        f"class to fall back to); registered kinds: {known}")
    return _unique([c for c in found if issubclass(c, expected)] or found, kind)


def _kind_of(cls: type) -> str:
    """The kind written for a plan of class ``cls``; raises ``PlanError`` if another defined
    plan class has the same kind, since the plan could not be read back."""
    kind = plan_kind(cls)
    _unique([c for c in plan_classes() if plan_kind(c) == kind], kind)
    return kind


MAX_DEPTH = 32
"""The deepest nesting of arrays and objects a plan's JSON may have (tidal's plans nest about
10 levels): deeper JSON is a ``PlanError`` before it is decoded."""

SHOWN_CHARS = 80
"""How much of a value read from a plan an error message echoes."""


def shown(value: Any) -> str:
    """``repr(value)`` cut to its first :data:`SHOWN_CHARS` characters (an error about a plan
    never echoes a huge value whole).

    >>> shown("x" * 1000)[-24:]
    'xxx... (1002 characters)'
    """
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def _not_finite(token: str) -> float:
    raise PlanError(f"plan JSON holds {shown(token)}: a plan's numbers are finite "
                    f"(NaN and Infinity are not JSON)")


def _finite(token: str) -> float:
    value = float(token)
    return value if math.isfinite(value) else _not_finite(token)


def _check_depth(data: Any) -> None:
    """Raise ``PlanError`` when ``data`` nests deeper than :data:`MAX_DEPTH` (iteratively)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise PlanError(f"plan JSON nests deeper than {MAX_DEPTH} levels of arrays and "
                            f"objects; a plan written by to_json nests far less")
        children = value.values() if isinstance(value, dict) else value \
            if isinstance(value, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def parse_plan_json(text: Any) -> Any:
    """The JSON value of a plan's text, every plan read goes through: ``PlanError`` for text
    that is not JSON, holds NaN or an infinite number, or nests deeper than
    :data:`MAX_DEPTH` (never a ``RecursionError``).

    >>> parse_plan_json('{"kind": "BurstPlan", "data": {"world": 2}}')["data"]
    {'world': 2}
    >>> parse_plan_json('{"time_us": NaN}')
    Traceback (most recent call last):
    ...
    tidal.ir.errors.PlanError: plan JSON holds 'NaN': a plan's numbers are finite ...
    >>> parse_plan_json("[" * 100 + "]" * 100)
    Traceback (most recent call last):
    ...
    tidal.ir.errors.PlanError: plan JSON nests deeper than 32 levels of arrays and objects; ...
    """
    if not isinstance(text, str):
        raise PlanError(f"plan JSON must be text (str), got {type(text).__name__}")
    try:
        data = json.loads(text, parse_constant=_not_finite, parse_float=_finite)
    except RecursionError:
        raise PlanError(f"plan JSON nests deeper than {MAX_DEPTH} levels of arrays and "
                        f"objects; a plan written by to_json nests far less") from None
    except ValueError as e:    # not JSON; an integer of more digits than Python converts
        raise PlanError(f"plan JSON is not valid: {shown(str(e))}") from None
    _check_depth(data)
    return data


def _encode(value: Any) -> Any:
    if isinstance(value, Plan):
        return {"kind": _kind_of(type(value)), "data": _encode_fields(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode_fields(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return [[_encode(k), _encode(v)] for k, v in value.items()]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise PlanError(f"cannot encode a {type(value).__name__} in a plan: {value!r}")


def _encode_fields(obj: Any) -> dict[str, Any]:
    return {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _decode(tp: Any, data: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _decode(arg, data, where)
            except (PlanError, TypeError, ValueError) as e:
                errors.append(str(e))
        raise PlanError(f"{where}: {shown(data)} matches none of {tp} "
                         f"({shown('; '.join(errors))})")
    if isinstance(tp, type) and issubclass(tp, Plan):
        if not isinstance(data, dict) or "kind" not in data:
            raise PlanError(f"{where}: expected a plan object with 'kind'")
        _no_unknown(data, ("kind", "data"), where, "a plan object")
        cls = _class_of(data["kind"], tp)
        if not issubclass(cls, tp):
            raise PlanError(f"{where}: plan kind {shown(data['kind'])} is not a {tp.__name__}")
        return _decode_fields(cls, data["data"], where)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode_fields(tp, data, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            raise PlanError(f"{where}: {shown(data)} is not a {tp.__name__} (one of "
                            f"{[m.value for m in tp]})") from None
    if origin is tuple:
        if not isinstance(data, list):
            raise PlanError(f"{where}: expected a list, got {shown(data)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
        if args and len(args) != len(data):
            raise PlanError(f"{where}: expected {len(args)} items, got {len(data)}")
        return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
    if origin is list:
        return [_decode(args[0] if args else Any, v, f"{where}[{i}]") for i, v in enumerate(data)]
    if origin in (dict, typing.Mapping) or tp is dict:
        kt, vt = args if args else (Any, Any)
        return {_decode(kt, k, where): _decode(vt, v, f"{where}[{shown(k)}]") for k, v in data}
    if tp is float:
        if not isinstance(data, (int, float)) or isinstance(data, bool):
            raise PlanError(f"{where}: expected a number, got {shown(data)}")
        return float(data)
    if tp in (int, str, bool):
        if type(data) is not tp:
            raise PlanError(f"{where}: expected {tp.__name__}, got {shown(data)}")
        return data
    if tp is type(None):
        if data is not None:
            raise PlanError(f"{where}: expected null, got {shown(data)}")
        return None
    raise PlanError(f"{where}: unsupported field type {tp!r}")


def _no_unknown(data: dict, known: Iterable[str], where: str, what: str) -> None:
    """Raise ``PlanError`` naming the keys of ``data`` that are not ``known`` fields of
    ``what`` (a misspelt or foreign field is never ignored)."""
    known = tuple(known)
    unknown = [k for k in data if k not in known]
    if unknown:
        names = ", ".join(shown(k) for k in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise PlanError(f"{where}: unknown field(s) {names}{more} for {what} (its fields: "
                        f"{', '.join(known)})")


def _decode_fields(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected an object for {cls.__name__}, got {shown(data)}")
    hints = typing.get_type_hints(cls)
    _no_unknown(data, [f.name for f in dataclasses.fields(cls)], where, cls.__name__)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            raise PlanError(f"{where}: {cls.__name__} is missing field {f.name!r}")
        kwargs[f.name] = _decode(hints[f.name], data[f.name], f"{where}.{f.name}")
    return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Base class of every plan. Subclasses are frozen dataclasses of JSON-able fields
    (numbers, strings, tuples, dicts, enums, nested dataclasses and plans). A subclass is
    registered by being defined; its JSON kind is its class name unless it sets its own
    ``plan_kind`` class attribute (needed only when two plan classes share a name)."""

    plan_kind: ClassVar[str] = ""
    pass_name: ClassVar[str] = ""
    """The registered pass that emits this kind ("" for any): a ``CompiledPlan`` that pairs
    a plan of this kind with another pass's name is a ``PlanError``."""

    def to_json(self) -> str:
        """The plan as JSON text, naming its class."""
        return json.dumps(_encode(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Read a plan written by ``to_json``; the kind named in the JSON must be a registered
        plan class, ``cls`` or a subclass (nothing is imported). Raises ``PlanError`` naming
        the field at fault or the unknown kind."""
        return _decode(cls, parse_plan_json(text), cls.__name__)

    def summary(self) -> str:
        """One line for reports; subclasses override with what matters most."""
        return type(self).__name__

    def world_size(self) -> Optional[int]:
        """The number of ranks this plan's program must run on, where the plan fixes it
        (None: any); subclasses that fix it override."""
        return None

    def table(self) -> str:
        """A multi-line human-readable view for reports and the CLI; subclasses override."""
        return self.to_json()


@dataclasses.dataclass(frozen=True)
class CompiledPlan(Plan):
    """Every plan ``compile()`` produced, by pass name, in the order the passes ran."""

    passes: tuple[tuple[str, Plan], ...] = ()

    def __post_init__(self) -> None:
        for name, plan in self.passes:
            if plan.pass_name and name != plan.pass_name:
                raise PlanError(f"CompiledPlan: a {plan_kind(type(plan))} is made by pass "
                                f"{plan.pass_name!r}, but here it is the plan of pass "
                                f"{shown(name)}")

    def world_mismatch(self, world: int) -> str:
        """Why these plans cannot run on ``world`` ranks ("" when they can): the first plan
        whose ``world_size()`` is another number, named with both sizes.

        >>> from tidal.ir.plans.burst import BurstPlan
        >>> plan = BurstPlan(4, 8, 2.0, "exact", (), (), 0.0, 0.0, 0.0, 0.0, 0.0)
        >>> CompiledPlan((("burst_parallel", plan),)).world_mismatch(2)
        "pass 'burst_parallel': the plan is for 4 GPUs but the job has 2 ranks; compile with ..."
        """
        for name, plan in self.passes:
            size = plan.world_size()
            if size is not None and size != world:
                return (f"pass {name!r}: the plan is for {size} GPUs but the job has {world} "
                        f"ranks; compile with tidal.Cluster(gpus={world}) (or leave cluster= "
                        f"out under torchrun) or run on {size} ranks")
        return ""

    def get(self, name: str) -> Plan | None:
        """The plan of pass ``name``, or None."""
        return dict(self.passes).get(name)

    def summary(self) -> str:
        return ", ".join(f"{n}: {p.summary()}" for n, p in self.passes) or "no plans"
