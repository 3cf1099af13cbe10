"""Host-side weight store: a safetensors file laid out in layer groups, read by memory map.

File layout (a valid safetensors file, readable by the ``safetensors`` package):

* 8 bytes little-endian header length, then the JSON header padded with spaces so that the
  data starts at a multiple of 512 bytes;
* the data: group after group, each group one contiguous buffer starting on a 512-byte block
  and padded to a whole number of blocks (PipeSwitch's transfer unit); inside a group each
  tensor starts on a 64-byte boundary. Padding is written as ``uint8`` tensors named
  ``__pad__.<n>`` because safetensors allows no holes between tensors;
* ``__metadata__``: ``tidal.format`` and ``tidal.groups`` (JSON list of ``[begin, end)`` byte
  ranges of the groups, relative to the data start).

:meth:`WeightStore.open` validates the file against what the model expects *before* anything
runs: a missing file, a truncated file or a file of another model (a tensor missing, or with
another shape, dtype or group) raises :class:`WeightStoreError` naming the first mismatching
tensor.

Example:
    >>> import tempfile, os, torch
    >>> from tidal.runtime.weight_store import WeightStore, write_store, TensorSpec
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> groups = [[("a", torch.ones(3))], [("b", torch.zeros(2, 2))]]
    >>> write_store(path, groups)
    >>> expected = [[TensorSpec.of("a", torch.ones(3))], [TensorSpec.of("b", torch.zeros(2, 2))]]
    >>> with WeightStore.open(path, expected) as store:
    ...     store.group_nbytes(1) % 512, store.tensor("a").tolist()
    (0, [1.0, 1.0, 1.0])
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import torch

from tidal.ir.errors import TidalError
from tidal.ir.meta import TensorInfo

BLOCK = 512
"""Group alignment and padding unit in bytes (PipeSwitch pads transfers to 512-byte blocks)."""
TENSOR_ALIGN = 64
"""Alignment of each tensor inside a group."""
FORMAT = "tidal-layer-groups-1"

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_CODES = {v: k for k, v in _DTYPES.items()}

PathLike = Union[str, os.PathLike]


class WeightStoreError(TidalError):
    """A weight store file is missing, truncated, malformed or written for another model."""


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of a tensor the model expects in the store."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        """The spec of ``tensor`` under ``name``."""
        return cls(name, tuple(tensor.shape), tensor.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the dense tensor."""
        return TensorInfo(self.shape, self.dtype).nbytes

    def describe(self) -> str:
        return f"{_DTYPES.get(self.dtype, str(self.dtype))}{list(self.shape)}"


def _round_up(x: int, unit: int) -> int:
    return (x + unit - 1) // unit * unit


def _raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def write_store(path: PathLike, groups: Sequence[Sequence[tuple[str, torch.Tensor]]],
                metadata: dict[str, str] | None = None) -> None:
    """Write ``groups`` (each a list of ``(name, tensor)``) as a grouped safetensors file."""
    header: dict[str, Any] = {}
    chunks: list[tuple[int, bytes]] = []
    ranges = []
    offset = pads = 0

    def pad_to(target: int) -> None:
        nonlocal offset, pads
        if target > offset:
            header[f"__pad__.{pads}"] = {"dtype": "U8", "shape": [target - offset],
                                         "data_offsets": [offset, target]}
            pads += 1
            offset = target

    seen: set[str] = set()
    for k, group in enumerate(groups):
        begin = offset
        for name, t in group:
            if name in seen or name.startswith("__"):
                raise WeightStoreError(f"write_store: tensor name {name!r} is repeated or "
                                       "reserved")
            if t.dtype not in _DTYPES:
                raise WeightStoreError(f"write_store: tensor {name!r} has unsupported dtype "
                                       f"{t.dtype}")
            seen.add(name)
            pad_to(_round_up(offset, TENSOR_ALIGN))
            data = _raw_bytes(t)
            header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + len(data)]}
            chunks.append((offset, data))
            offset += len(data)
        pad_to(_round_up(max(offset, begin + 1), BLOCK))
        ranges.append([begin, offset])
    meta = {"tidal.format": FORMAT, "tidal.groups": json.dumps(ranges), **(metadata or {})}
    header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (_round_up(8 + len(text), BLOCK) - 8 - len(text))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        start = f.tell()
        for off, data in chunks:
            f.seek(start + off)
            f.write(data)
        f.seek(start + offset)
        f.truncate()
        f.flush()
        os.fsync(f.fileno())


def drop_page_cache(path: PathLike) -> None:
    """Ask the kernel to drop the file's pages from the page cache (``posix_fadvise
    DONTNEED``), so the next read comes from the disk. Best effort; no-op where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class WeightStore:
    """An open, validated store: a memory map of the file and the location of every tensor.

    Open with :meth:`open`; ``group_region(k)`` is group ``k``'s contiguous buffer (a
    ``uint8`` tensor viewing the map) and ``group_tensors(k)`` where each tensor sits in it.
    """

    def __init__(self, path: Path, mm: mmap.mmap, data_start: int,
                 layout: list[list[tuple[TensorSpec, int]]], ranges: list[tuple[int, int]]):
        self.path = path
        self._mm = mm
        self._data_start = data_start
        self._layout = layout
        self._ranges = ranges

    @classmethod
    def open(cls, path: PathLike, expected: Sequence[Sequence[TensorSpec]]) -> "WeightStore":
        """Open ``path`` and check it holds exactly the ``expected`` groups of tensors.
        Raises ``WeightStoreError`` naming the first missing, mismatching or truncated tensor."""
        path = Path(path)
        header, data_start, size = _read_header(path)
        try:
            ranges = [tuple(r) for r in json.loads(header.get("__metadata__", {})
                                                   .get("tidal.groups", "null"))]
        except (TypeError, ValueError):
            raise WeightStoreError(f"weight store {path}: no tidal group table in its "
                                   "metadata (not written by tidal's write_store)") from None
        if len(ranges) != len(expected):
            raise WeightStoreError(f"weight store {path} has {len(ranges)} groups, the model's "
                                   f"plan has {len(expected)} (written for another grouping)")
        layout: list[list[tuple[TensorSpec, int]]] = []
        wanted = set()
        for k, group in enumerate(expected):
            begin, end = ranges[k]
            entries = []
            for spec in group:
                wanted.add(spec.name)
                entry = header.get(spec.name)
                if entry is None:
                    raise WeightStoreError(f"weight store {path}: tensor {spec.name!r} is "
                                           "missing (file written for another model?)")
                have = TensorSpec(spec.name, tuple(entry.get("shape", ())),
                                  _CODES.get(entry.get("dtype"), torch.uint8))
                if entry.get("dtype") not in _CODES or have != spec:
                    raise WeightStoreError(
                        f"weight store {path}: tensor {spec.name!r} is "
                        f"{entry.get('dtype')}{list(have.shape)} in the file but "
                        f"{spec.describe()} in the model")
                lo, hi = entry["data_offsets"]
                if hi - lo != spec.nbytes:
                    raise WeightStoreError(f"weight store {path}: tensor {spec.name!r} has "
                                           f"{hi - lo} bytes, expected {spec.nbytes}")
                if not (begin <= lo and hi <= end):
                    raise WeightStoreError(f"weight store {path}: tensor {spec.name!r} is "
                                           f"not in group {k} (written for another grouping)")
                if data_start + hi > size:
                    raise WeightStoreError(
                        f"weight store {path} is truncated: tensor {spec.name!r} needs bytes "
                        f"up to {data_start + hi}, the file has {size}")
                entries.append((spec, lo - begin))
            layout.append(entries)
        extra = [n for n in header if n != "__metadata__" and not n.startswith("__pad__.")
                 and n not in wanted]
        if extra:
            raise WeightStoreError(f"weight store {path}: tensor {extra[0]!r} is not in the "
                                   "model (file written for another model?)")
        if data_start + ranges[-1][1] > size:
            raise WeightStoreError(f"weight store {path} is truncated: group {len(ranges) - 1}"
                                   f" ends at byte {data_start + ranges[-1][1]}, the file has "
                                   f"{size}")
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return cls(path, mm, data_start, layout, ranges)

    @property
    def num_groups(self) -> int:
        return len(self._ranges)

    def group_nbytes(self, k: int) -> int:
        """Bytes of group ``k``'s buffer (a multiple of 512)."""
        begin, end = self._ranges[k]
        return end - begin

    def group_region(self, k: int) -> torch.Tensor:
        """Group ``k``'s contiguous buffer as a ``uint8`` tensor viewing the memory map (no
        read happens until it is touched)."""
        begin, end = self._ranges[k]
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=end - begin,
                                offset=self._data_start + begin)

    def group_tensors(self, k: int) -> list[tuple[TensorSpec, int]]:
        """The tensors of group ``k`` with their byte offsets inside its buffer."""
        return list(self._layout[k])

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, copied out of the map (for inspection and tests)."""
        for k, entries in enumerate(self._layout):
            for spec, off in entries:
                if spec.name == name:
                    return view_tensor(self.group_region(k), spec, off).clone()
        raise KeyError(name)

    def close(self) -> None:
        """Unmap the file (tensors viewing it must be gone)."""
        try:
            self._mm.close()
        except BufferError:  # a view is still alive; the map is freed with it
            pass

    def __enter__(self) -> "WeightStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def view_tensor(buffer: torch.Tensor, spec: TensorSpec, offset: int) -> torch.Tensor:
    """The tensor ``spec`` at byte ``offset`` of a ``uint8`` group buffer, as a view."""
    raw = buffer[offset:offset + spec.nbytes]
    return raw.view(spec.dtype).reshape(spec.shape)


def _read_header(path: Path) -> tuple[dict, int, int]:
    if not path.exists():
        raise WeightStoreError(f"weight store {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightStoreError(f"weight store {path} is truncated: {size} bytes, no header")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise WeightStoreError(f"weight store {path} is truncated: header needs {8 + n} "
                                   f"bytes, the file has {size}")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise WeightStoreError(f"weight store {path}: header is not valid JSON ({e})") \
                from None
    if not isinstance(header, dict):
        raise WeightStoreError(f"weight store {path}: header is not a JSON object")
    return header, 8 + n, size
