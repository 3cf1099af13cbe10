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
import types
import typing
from typing import Any, ClassVar, Iterator

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
        raise PlanError(f"plan kind {kind!r} is not a string")
    classes = plan_classes()
    module, legacy, qualname = kind.rpartition(":")
    if legacy:  # written by an older tidal as "module:QualName": match the QualName only
        found = [c for c in classes if c.__qualname__ == qualname]
        found = [c for c in found if c.__module__ == module] or found
    else:
        found = [c for c in classes if plan_kind(c) == kind]
    if not found:
        known = ", ".join(sorted({plan_kind(c) for c in classes}))
        raise PlanError(f"unknown plan kind {kind!r}: no registered plan class has that name "
                        f"(plan kinds are looked up, never imported, so there is no importable "
                        f"class to fall back to); registered kinds: {known}")
    return _unique([c for c in found if issubclass(c, expected)] or found, kind)


def _kind_of(cls: type) -> str:
    """The kind written for a plan of class ``cls``; raises ``PlanError`` if another defined
    plan class has the same kind, since the plan could not be read back."""
    kind = plan_kind(cls)
    _unique([c for c in plan_classes() if plan_kind(c) == kind], kind)
    return kind


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
        raise PlanError(f"{where}: {data!r} matches none of {tp} ({'; '.join(errors)})")
    if isinstance(tp, type) and issubclass(tp, Plan):
        if not isinstance(data, dict) or "kind" not in data:
            raise PlanError(f"{where}: expected a plan object with 'kind'")
        cls = _class_of(data["kind"], tp)
        if not issubclass(cls, tp):
            raise PlanError(f"{where}: plan kind {data['kind']} is not a {tp.__name__}")
        return _decode_fields(cls, data["data"], where)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode_fields(tp, data, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(data)
    if origin is tuple:
        if not isinstance(data, list):
            raise PlanError(f"{where}: expected a list, got {data!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
        if args and len(args) != len(data):
            raise PlanError(f"{where}: expected {len(args)} items, got {len(data)}")
        return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
    if origin is list:
        return [_decode(args[0] if args else Any, v, f"{where}[{i}]") for i, v in enumerate(data)]
    if origin in (dict, typing.Mapping) or tp is dict:
        kt, vt = args if args else (Any, Any)
        return {_decode(kt, k, where): _decode(vt, v, f"{where}[{k!r}]") for k, v in data}
    if tp is float:
        if not isinstance(data, (int, float)) or isinstance(data, bool):
            raise PlanError(f"{where}: expected a number, got {data!r}")
        return float(data)
    if tp in (int, str, bool):
        if type(data) is not tp:
            raise PlanError(f"{where}: expected {tp.__name__}, got {data!r}")
        return data
    if tp is type(None):
        if data is not None:
            raise PlanError(f"{where}: expected null, got {data!r}")
        return None
    raise PlanError(f"{where}: unsupported field type {tp!r}")


def _decode_fields(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected an object for {cls.__name__}, got {data!r}")
    hints = typing.get_type_hints(cls)
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

    def to_json(self) -> str:
        """The plan as JSON text, naming its class."""
        return json.dumps(_encode(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Read a plan written by ``to_json``; the kind named in the JSON must be a registered
        plan class, ``cls`` or a subclass (nothing is imported). Raises ``PlanError`` naming
        the field at fault or the unknown kind."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan JSON is not valid: {e}") from None
        return _decode(cls, data, cls.__name__)

    def summary(self) -> str:
        """One line for reports; subclasses override with what matters most."""
        return type(self).__name__

    def table(self) -> str:
        """A multi-line human-readable view for reports and the CLI; subclasses override."""
        return self.to_json()


@dataclasses.dataclass(frozen=True)
class CompiledPlan(Plan):
    """Every plan ``compile()`` produced, by pass name, in the order the passes ran."""

    passes: tuple[tuple[str, Plan], ...] = ()

    def get(self, name: str) -> Plan | None:
        """The plan of pass ``name``, or None."""
        return dict(self.passes).get(name)

    def summary(self) -> str:
        return ", ".join(f"{n}: {p.summary()}" for n, p in self.passes) or "no plans"
