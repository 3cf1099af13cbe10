"""The error a ``tidal`` subcommand raises for an argument it cannot use, the one place that
turns a Python error raised while *reading and building the inputs* into one, and the limits
and the ``--input-shape`` grammar that the argument types (``tidal.compiler.cli_args``) and the
MODEL loader (``tidal.compiler.model_spec``) share.

Its own module so that those two both use it without importing each other. Imports no torch.

Only the input stage is wrapped (:func:`bad_input`): a ``ValueError`` raised later, deep inside a
pass, is a bug and stays a traceback; the CLI's ``main`` catches ``TidalError`` alone.

Example:
    >>> from tidal.compiler.cli_errors import UsageError, bad_input
    >>> from tidal.ir.errors import TidalError
    >>> err = UsageError("--batch 0: must be at least 1")
    >>> isinstance(err, TidalError) and isinstance(err, ValueError), str(err)
    (True, '--batch 0: must be at least 1')
    >>> try:
    ...     with bad_input("--sweep 1,x"):
    ...         float("x")
    ... except UsageError as e:
    ...     print(e)
    --sweep 1,x: could not convert string to float: 'x'
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Iterator, Optional

from tidal.ir.errors import TidalError

INPUT_ERRORS = (ValueError, TypeError, OverflowError, MemoryError, OSError)
"""What a bad input (or a file it names that cannot be read) makes Python or torch raise while
the CLI reads and builds it."""

MAX_COUNT = 2**31 - 1
"""The largest count (batch, GPUs, iterations, ...) an option takes: beyond it, sizes overflow
the int32/int64 arithmetic of the passes and kernels long before anything useful runs."""

MAX_INPUT_ELEMENTS = 2**28
"""The most elements the example inputs built from the command line may hold together (1 GiB of
float32): a larger ``--batch`` or ``--input-shape`` is refused, naming the count, instead of
being allocated (and then run through the model)."""

SHOWN_CHARS = 60
"""How much of a refused value an error message quotes."""


def shown(text: str) -> str:
    """``text`` quoted for an error message, cut to ``SHOWN_CHARS`` characters."""
    if len(text) <= SHOWN_CHARS:
        return repr(text)
    return f"{text[:SHOWN_CHARS]!r}... ({len(text):,} characters)"


_ALLOCATION_FAILURES = ("can't allocate memory", "not enough memory", "out of memory")
"""Words of torch's messages for a failed allocation."""


class UsageError(TidalError, ValueError):
    """A command-line argument that cannot be used; the message names the argument."""


MAX_LINE = 1000
"""The most characters of an error message the CLI prints: a huge value given on the command
line is not echoed whole."""


def clip(text: str, limit: int = MAX_LINE) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was.

    Example:
        >>> clip("x" * 5000, 10)
        'xxxxxxxxxx... (5,000 characters)'
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def one_line(error: BaseException) -> str:
    """The error's message on one line (a multi-line message's lines joined with ' | '), cut
    to ``MAX_LINE`` characters.

    Example:
        >>> one_line(ValueError("first\\n  second\\n"))
        'first | second'
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return clip(" | ".join(lines)) or type(error).__name__


def allocation_failed(error: BaseException) -> bool:
    """Whether ``error`` is torch's failure to allocate memory (a ``RuntimeError`` on the CPU,
    ``torch.OutOfMemoryError`` on a GPU) or Python's ``MemoryError``.

    Example:
        >>> allocation_failed(RuntimeError("DefaultCPUAllocator: can't allocate memory: ..."))
        True
        >>> allocation_failed(RuntimeError("shape mismatch"))
        False
    """
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(s in text for s in _ALLOCATION_FAILURES)


@contextlib.contextmanager
def bad_input(what: Optional[str] = None) -> Iterator[None]:
    """Run the block that reads or builds inputs from the command line: a ``ValueError``,
    ``TypeError``, ``OverflowError``, ``MemoryError``, ``OSError`` or failed torch allocation
    raised in it is a :class:`UsageError` (the original chained) whose message starts with
    ``what`` (the option and value at fault) when given. A ``TidalError`` passes through
    unchanged; any other exception is left alone (a bug, not bad input)."""
    try:
        yield
    except TidalError:
        raise
    except Exception as e:
        if not (isinstance(e, INPUT_ERRORS) or allocation_failed(e)):
            raise
        message = one_line(e)
        if allocation_failed(e):
            message = f"too large to allocate ({message})"
        raise UsageError(f"{what}: {message}" if what else message) from e


@dataclass(frozen=True)
class ShapeSpec:
    """An ``--input-shape``: ``dtype`` (``"float"`` or ``"long"``), ``high`` (token ids are
    below it) and ``dims`` without the batch."""

    dtype: str
    high: int
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        """Elements of one sample."""
        return math.prod(self.dims)


def parse_shape(text: str) -> ShapeSpec:
    """``3,224,224`` (float), ``long:16`` or ``long[1000]:16`` (token ids below 1000, default
    100) -> a :class:`ShapeSpec` with positive dims; ``ValueError`` saying what is wrong.

    Example:
        >>> parse_shape("long[30522]:128")
        ShapeSpec(dtype='long', high=30522, dims=(128,))
        >>> parse_shape("3,,4")
        Traceback (most recent call last):
        ...
        ValueError: '3,,4': dims must be integers like 3,224,224
    """
    dtype_part, sep, dims = text.rpartition(":")
    if not dims.strip():
        raise ValueError(f"{shown(text)}: give an input's dims without the batch, e.g. "
                         "3,224,224 or long[30522]:128")
    dtype, high = "float", 100
    if sep and dtype_part.startswith("long"):
        dtype = "long"
        if dtype_part != "long":
            m = re.fullmatch(r"long\[\s*(-?[0-9]+)\s*\]", dtype_part)
            if m is None:
                raise ValueError(f"{shown(text)}: expected long[N]:dims")
            high = int(m.group(1))
            if not 1 <= high <= MAX_COUNT:
                raise ValueError(f"{shown(text)}: the token id bound N of long[N] must be "
                                 f"at least 1 (and at most {MAX_COUNT})")
    elif sep:
        raise ValueError(f"{shown(text)}: the only dtype prefix is long")
    parts = [d.strip() for d in dims.replace("x", ",").split(",")]
    if not all(re.fullmatch(r"-?[0-9]+", d) for d in parts):
        raise ValueError(f"{shown(text)}: dims must be integers like 3,224,224")
    shape = tuple(int(d) for d in parts)
    if any(d <= 0 for d in shape):
        raise ValueError(f"{shown(text)}: dims must be positive")
    spec = ShapeSpec(dtype, high, shape)
    if spec.elements > MAX_INPUT_ELEMENTS:
        raise ValueError(f"{shown(text)}: too large: {spec.elements:,} elements per sample (at "
                         f"most {MAX_INPUT_ELEMENTS:,} in all)")
    return spec


def check_input_size(what: str, elements: int) -> None:
    """A ``UsageError`` naming ``what`` when example inputs of ``elements`` elements are more
    than ``MAX_INPUT_ELEMENTS``, before anything is allocated.

    Example:
        >>> try:
        ...     check_input_size("--batch 1000000000000", 12 * 10**12)
        ... except UsageError as e:
        ...     print(str(e)[:61])
        --batch 1000000000000: the example inputs are too large: 12,0
    """
    if elements > MAX_INPUT_ELEMENTS:
        raise UsageError(f"{what}: the example inputs are too large: {elements:,} elements "
                         f"(at most {MAX_INPUT_ELEMENTS:,})")
