"""The compressor interface: ``encode`` -> the collective -> ``decode``, with checkpointable state.

A compressor turns one local gradient tensor into a :class:`Message` (the tensors to put on the
wire and which collective they need: ``"all_reduce"`` (sum) or ``"all_gather"``). The driver
(:func:`tidal.runtime.comm.compressors.comm.synchronize`) runs the collective and hands the result to
``decode``, which returns either the synchronized tensor (the average over ranks, or the majority
vote for signSGD) or another :class:`Message` for a further round (PowerSGD's P then Q).

Error feedback (``error_feedback=True``) adds the residual of the previous step to the gradient
before compressing and keeps ``M - local_approximation`` as the new residual, so that
``local_approximation + residual == M`` exactly.

Randomness never comes from a shared sequential generator: each draw is seeded from
``(seed, key, step[, rank])``, so results do not depend on bucket order and the only random
state to checkpoint is the per-key step counter.

Example:
    >>> import torch
    >>> from tidal.runtime.comm.compressors import make_compressor, synchronize
    >>> c = make_compressor("topk:0.5")
    >>> out = synchronize(c, {"w": torch.tensor([1.0, -4.0, 0.5, 3.0])})
    >>> out["w"].tolist(), c.residual("w").tolist()
    ([0.0, -4.0, 0.0, 3.0], [1.0, 0.0, 0.5, 0.0])
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Union

import torch

from tidal.ir import compression_model
from tidal.ir.compression_model import CompressorSpec

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"


@dataclass(frozen=True)
class World:
    """This rank's index and the number of ranks taking part."""

    rank: int = 0
    size: int = 1


@dataclass(frozen=True)
class Message:
    """Tensors to send and the collective they need. ``ctx`` is private to the compressor and
    comes back to ``decode`` unchanged (shapes, the local matrix, ...)."""

    tensors: tuple[torch.Tensor, ...]
    op: str = ALL_REDUCE
    ctx: Any = None

    def __post_init__(self) -> None:
        if self.op not in (ALL_REDUCE, ALL_GATHER):
            raise ValueError(f"Message(op={self.op!r}): must be {ALL_REDUCE!r} or {ALL_GATHER!r}")

    @property
    def nbytes(self) -> int:
        """Bytes this rank puts into the collective."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


def stable_seed(*parts: Union[int, str]) -> int:
    """A 63-bit seed from ints and strings that is the same in every process."""
    text = "\x1f".join(str(p) for p in parts)
    return (zlib.crc32(text.encode()) << 31 | zlib.crc32(text[::-1].encode())) & (2**63 - 1)


def seeded_generator(*parts: Union[int, str]) -> torch.Generator:
    """A CPU generator seeded with :func:`stable_seed` of ``parts``."""
    return torch.Generator().manual_seed(stable_seed(*parts))


class Compressor:
    """Base class. Subclasses set ``name`` (a name of :data:`tidal.ir.compression_model.KINDS`,
    which gives ``all_reduce_compatible``, ``rounds``, the levels and the options) and implement
    ``encode`` and ``decode``; ``level`` is the knob Accordion turns (PowerSGD rank,
    Top-K/random-K fraction, QSGD levels), settable per key with ``set_level``. Levels,
    payload bytes and the spec come from :mod:`tidal.ir.compression_model`, as the
    ``compression`` pass counts them."""

    name: ClassVar[str] = ""
    all_reduce_compatible: ClassVar[bool] = True
    rounds: ClassVar[int] = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            k = compression_model.kind(cls.name)
            cls.all_reduce_compatible, cls.rounds = k.all_reduce, k.rounds

    def __init__(self, *, error_feedback: bool, seed: int = 0):
        self.error_feedback = bool(error_feedback)
        self.seed = int(seed)
        self._errors: dict[str, torch.Tensor] = {}
        self._steps: dict[str, int] = {}
        self._levels: dict[str, Any] = {}

    # -- the knob ----------------------------------------------------------------------------
    @property
    def default_level(self) -> Any:
        """The level used for keys with no override (None for compressors with no knob)."""
        return None

    def check_level(self, level: Any) -> Any:
        """Validate ``level``; raise ``ValueError`` naming it when it is out of range."""
        return compression_model.check_level(self.name, level)

    def level(self, key: str) -> Any:
        """The level in force for ``key``."""
        return self._levels.get(key, self.default_level)

    def set_level(self, key: str, level: Any) -> None:
        """Use ``level`` for ``key`` from the next step on."""
        self._levels[key] = self.check_level(level)

    def options(self) -> dict[str, Any]:
        """The keyword options this compressor was built with (``seed``, ``error_feedback``,
        ...), by name."""
        return {k: getattr(self, k) for k in compression_model.kind(self.name).defaults}

    def spec_data(self) -> CompressorSpec:
        """The spec as data: name, default level and the options that differ from the
        defaults."""
        return CompressorSpec.of(self.name, self.default_level, **self.options())

    def spec(self) -> str:
        """``name[:level][,option=value...]`` as :func:`make_compressor` parses it: it
        rebuilds this compressor (without its state)."""
        return str(self.spec_data())

    # -- the protocol ------------------------------------------------------------------------
    def encode(self, key: str, tensor: torch.Tensor, world: World) -> Message:
        """The first message for ``tensor`` (the local gradient of parameter ``key``)."""
        raise NotImplementedError

    def decode(self, key: str, message: Message, reduced: tuple[torch.Tensor, ...],
               world: World, out: Optional[torch.Tensor] = None) -> Union[torch.Tensor, Message]:
        """The synchronized tensor from the collective's result (``reduced``: summed tensors
        for all-reduce, ``[world, ...]``-stacked tensors for all-gather), or the next message.
        ``out`` (the input's shape, any float dtype): where the caller wants the result; a
        compressor may write it there and return ``out`` itself (the caller copies otherwise).
        May run on another thread than ``encode`` (a collective's callback)."""
        raise NotImplementedError

    def payload_bytes(self, shape: tuple[int, ...], level: Any = None) -> int:
        """Bytes one rank sends for a tensor of ``shape`` per step, summed over rounds
        (:func:`tidal.ir.compression_model.payload_bytes`)."""
        return compression_model.payload_bytes(
            self.name, shape, self.default_level if level is None else level, self.options())

    def uncompressed(self, shape: tuple[int, ...], level: Any = None) -> bool:
        """Whether a tensor of ``shape`` is sent as is (too small to be worth compressing)."""
        return compression_model.uncompressed(
            self.name, shape, self.default_level if level is None else level, self.options())

    # -- helpers for subclasses --------------------------------------------------------------
    def _with_error(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``M``: ``tensor`` plus the stored residual, float32 on ``tensor``'s device (the sum
        is computed in float32, so bf16/fp16 gradients work). With error feedback it is a
        contiguous tensor this compressor owns: the residual's own storage (taken out of the
        state), which :meth:`_keep_error` turns into the next residual in place, so a step
        allocates nothing the size of the gradient. Without, it may be ``tensor`` itself:
        read it, never write it."""
        t = tensor.detach()
        if not self.error_feedback:
            return t if t.dtype == torch.float32 else t.to(torch.float32)
        err = self._errors.pop(key, None)
        if err is None:
            return t.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
        if err.shape != t.shape:
            self._errors[key] = err
            raise ValueError(f"compressor {self.name!r}: key {key!r} changed shape from "
                             f"{tuple(err.shape)} to {tuple(t.shape)}")
        if err.device != t.device or err.dtype != torch.float32 or not err.is_contiguous():
            err = err.to(t.device, torch.float32, memory_format=torch.contiguous_format)
        return err.add_(t)

    def _keep_error(self, key: str, m: torch.Tensor,
                    approx: Union[None, torch.Tensor, tuple[torch.Tensor, torch.Tensor]],
                    shape: tuple[int, ...]) -> None:
        """Keep ``m - approx`` (in the gradient's ``shape``) as ``key``'s residual, computed in
        ``m``'s storage (``m`` from :meth:`_with_error`). ``approx``: a tensor, ``(p, q)`` for
        the low-rank ``p @ q.T`` (one fused pass), or None when ``m`` already holds the
        residual. Nothing without error feedback."""
        if not self.error_feedback:
            return
        if isinstance(approx, tuple):
            m.addmm_(approx[0], approx[1].t(), alpha=-1)
        elif approx is not None:
            m.sub_(approx)
        self._errors[key] = m.view(shape)

    def _next_step(self, key: str) -> int:
        step = self._steps.get(key, 0)
        self._steps[key] = step + 1
        return step

    def residual(self, key: str) -> Optional[torch.Tensor]:
        """A copy of the error-feedback residual kept for ``key`` (None before its first
        step; the kept one is updated in place by the next step)."""
        err = self._errors.get(key)
        return None if err is None else err.clone()

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit for bit: residuals, step counters, levels."""
        return {"name": self.name, "errors": {k: v.clone() for k, v in self._errors.items()},
                "steps": dict(self._steps), "levels": dict(self._levels)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        if state.get("name") != self.name:
            raise ValueError(f"state of compressor {state.get('name')!r} loaded into "
                             f"{self.name!r}")
        self._errors = {k: v.clone() for k, v in state["errors"].items()}
        self._steps = dict(state["steps"])
        self._levels = {k: self.check_level(v) for k, v in state["levels"].items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()!r}, error_feedback={self.error_feedback})"


def plain_message(tensor: torch.Tensor, dtype: Optional[torch.dtype] = torch.float32
                  ) -> Message:
    """A tensor sent uncompressed: all-reduce of its values as ``dtype`` (float32, the wire
    format of the compressors; ``None`` keeps the tensor's own dtype). The message may view
    ``tensor``: :class:`~tidal.runtime.comm.compressors.comm.Comm` packs it into a buffer of its
    own when it issues the collective."""
    values = tensor.detach() if dtype is None else tensor.detach().to(dtype)
    return Message((values.reshape(-1),), ALL_REDUCE, ctx=("plain", tuple(tensor.shape)))


def plain_decode(message: Message, reduced: tuple[torch.Tensor, ...], world: World,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The average of an uncompressed all-reduce (written into ``out`` when given)."""
    summed = reduced[0].view(message.ctx[1])
    return summed / world.size if out is None else torch.div(summed, world.size, out=out)


class NoCompression(Compressor):
    """Plain averaging all-reduce (sync SGD): the baseline the others are measured against."""

    name = "none"
    all_reduce_compatible = True

    def __init__(self, *, seed: int = 0):
        super().__init__(error_feedback=False, seed=seed)

    def encode(self, key: str, tensor: torch.Tensor, world: World) -> Message:
        return plain_message(tensor, dtype=None)  # in the gradient's dtype: exactly sync SGD

    def decode(self, key: str, message: Message, reduced: tuple[torch.Tensor, ...],
               world: World, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return plain_decode(message, reduced, world, out)
