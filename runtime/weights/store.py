"""Host-side weight store: a safetensors file laid out in layer groups, read by memory map.

File layout (a valid safetensors file, readable by the ``safetensors`` package):

* 8 bytes little-endian header length, then the JSON header padded with spaces so that the
  data starts at a multiple of 512 bytes;
* the data: group after group, each group one contiguous buffer starting on a 512-byte block
  and padded to a whole number of blocks (PipeSwitch's transfer unit); inside a group each
  tensor starts on a 64-byte boundary. Padding is written as ``uint8`` tensors named
  ``__pad__.<n>`` because safetensors allows no holes between tensors;
* ``__metadata__``: ``tidal.format`` (the format version, :data:`FORMAT`), ``tidal.groups``
  (JSON list of ``[begin, end)`` byte ranges of the groups, relative to the data start) and
  ``tidal.sum64`` (JSON object: the :func:`checksum` of each tensor's bytes).

:meth:`WeightStore.open` validates the file against what the model expects *before* anything
runs: a missing file, a truncated file, a store written by an older tidal (format
``tidal-layer-groups-1``, no checksums: rewrite it) or a file of another model (a tensor
missing, or with another shape, dtype or group) raises :class:`WeightStoreError` naming the
first mismatching tensor; the tensors are compared before the group count, so a store of
another model names the first tensor that differs. The data itself is checked as it is read:
:meth:`WeightStore.verify` runs one checksum pass over a group's bytes (the loader calls it on the
copy it reads out of the file, before the group's parameters point at anything made from it),
so bytes overwritten since the store was written (random bytes, NaNs) raise
:class:`WeightStoreError` naming the tensor and its group instead of loading silently. The check
is made once per read from the file, not at every load: where the device is not host memory
(a GPU), the bytes are read once into a :class:`HostCopy` and verified there, and the device
copies come from it.

A :class:`HostCopy` is a loader's host-side copy of a store (pinned for a GPU's DMA): one
buffer allocated once and reused by every later load, each group read from the file and
verified once (again only if the file changed), so a reload copies verified bytes without
reading the disk or checksumming them again (PipeSwitch keeps the models it switches between in
pinned host memory).

Example:
    >>> import tempfile, os, torch
    >>> from tidal.runtime.weights.store import WeightStore, write_store, TensorSpec
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
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from tidal.ir.errors import TidalError
from tidal.ir.meta import TensorInfo

BLOCK = 512
"""Group alignment and padding unit in bytes (PipeSwitch pads transfers to 512-byte blocks)."""
TENSOR_ALIGN = 64
"""Alignment of each tensor inside a group."""
FORMAT = "tidal-layer-groups-2"
"""Format version written in the metadata; version 2 added a checksum per tensor."""
OLD_FORMATS = ("tidal-layer-groups-1",)
"""Formats of older tidal versions: rejected with a message to rewrite the store."""

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


def checksum(data: Any) -> int:
    """The checksum stored for a tensor: its bytes (any buffer) read as little-endian 64-bit
    words, a trailing partial word zero-padded, summed modulo 2**64. One memory-bound pass
    (several times faster than ``zlib.crc32``, which would slow pipelined loading by about
    half); it catches bytes overwritten (random bytes, NaNs, zeros, another model's weights),
    not 8-byte words swapped within one tensor."""
    raw = np.frombuffer(data, dtype=np.uint8)
    whole = len(raw) // 8 * 8
    total = int(np.add.reduce(raw[:whole].view("<u8"), dtype=np.uint64))
    return (total + int.from_bytes(raw[whole:].tobytes(), "little")) % (1 << 64)


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
    checksums: dict[str, int] = {}
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
            checksums[name] = checksum(data)
            header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + len(data)]}
            chunks.append((offset, data))
            offset += len(data)
        pad_to(_round_up(max(offset, begin + 1), BLOCK))
        ranges.append([begin, offset])
    meta = {**(metadata or {}), "tidal.format": FORMAT, "tidal.groups": json.dumps(ranges),
            "tidal.sum64": json.dumps(checksums)}
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
    ``uint8`` tensor viewing the map), ``group_tensors(k)`` where each tensor sits in it, and
    ``verify(k, buffer)`` checks a copy of the group against the checksums in the header.
    """

    def __init__(self, path: Path, mm: mmap.mmap, data_start: int,
                 layout: list[list[tuple[TensorSpec, int]]], ranges: list[tuple[int, int]],
                 checksums: dict[str, int], identity: tuple = ()):
        self.path = path
        self.identity = identity
        """(device, inode, size, modification time) of the file when it was opened: another
        value means other bytes."""
        self._mm = mm
        self._data_start = data_start
        self._layout = layout
        self._ranges = ranges
        self._checksums = checksums

    @classmethod
    def open(cls, path: PathLike, expected: Sequence[Sequence[TensorSpec]]) -> "WeightStore":
        """Open ``path`` and check it holds exactly the ``expected`` groups of tensors.
        Raises ``WeightStoreError`` naming the first missing, mismatching or truncated tensor
        (the tensors are compared before the grouping, so a store of another model names the
        first tensor that differs), or saying the store was written by an older tidal."""
        path = Path(path)
        header, data_start, size = _read_header(path)
        ranges, checksums = _tidal_metadata(path, header)
        entries = _file_entries(path, header)
        _check_same_tensors(path, entries, [s for g in expected for s in g])
        if len(ranges) != len(expected):
            raise WeightStoreError(f"weight store {path} has {len(ranges)} groups, the model's "
                                   f"plan has {len(expected)} (written for another grouping)")
        layout = [_group_layout(path, k, ranges[k], group, entries, data_start, size)
                  for k, group in enumerate(expected)]
        missing = [s.name for g in expected for s in g if s.name not in checksums]
        if missing:
            raise WeightStoreError(f"weight store {path}: no checksum for tensor {missing[0]!r} "
                                   "in its header (damaged header); rewrite the store")
        if data_start + ranges[-1][1] > size:
            raise WeightStoreError(f"weight store {path} is truncated: group {len(ranges) - 1}"
                                   f" ends at byte {data_start + ranges[-1][1]}, the file has "
                                   f"{size}")
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            st = os.fstat(f.fileno())
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        return cls(path, mm, data_start, layout, ranges, checksums, identity)

    def verify(self, k: int, buffer: torch.Tensor) -> None:
        """Check the tensors of group ``k`` in ``buffer`` (a ``uint8`` CPU tensor holding the
        group's bytes: :meth:`group_region` or a copy of it) against the checksums written
        with them: one :func:`checksum` pass over the bytes. Raises ``WeightStoreError`` naming the
        first tensor whose bytes changed since the store was written."""
        for spec, offset in self._layout[k]:
            self._verify_one(k, spec, buffer[offset:offset + spec.nbytes])

    def _verify_one(self, k: int, spec: TensorSpec, raw: torch.Tensor) -> None:
        if checksum(raw.numpy()) != self._checksums[spec.name]:
            raise WeightStoreError(
                f"weight store {self.path}: tensor {spec.name!r} (group {k}) does not match "
                "the checksum written with it: its bytes are corrupt; rewrite the store")

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
        """One tensor, copied out of the map and verified (for inspection and tests)."""
        for k, entries in enumerate(self._layout):
            for spec, off in entries:
                if spec.name == name:
                    raw = self.group_region(k)[off:off + spec.nbytes].clone()
                    self._verify_one(k, spec, raw)
                    return view_tensor(raw, spec, 0)
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


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A ``uint8`` host buffer of ``nbytes`` (page-locked when ``pin``: a GPU copies from it
    asynchronously, by DMA)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class HostCopy:
    """A store's groups in one host buffer (see the module docstring), for a loader whose
    device is not host memory: ``group(store, k)`` gives group ``k``'s bytes, read from the
    file and verified the first time (:meth:`WeightStore.verify`) and as they are afterwards.
    The buffer (:func:`host_buffer`, pinned when ``pin``) is allocated once, on first use, and
    reused for every later load; the groups are read again only when the store's file changed
    (another :attr:`WeightStore.identity`). A group whose check failed is read again next time.
    Loads must have finished reading the buffer (their copies done) before a changed file is
    read into it: a loader runs one load at a time and a run ends when its copies have.

    Example:
        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> write_store(path, [[("a", torch.ones(3))], [("b", torch.zeros(2))]])
        >>> specs = [[TensorSpec.of("a", torch.ones(3))], [TensorSpec.of("b", torch.zeros(2))]]
        >>> copy = HostCopy(pin=False)
        >>> with WeightStore.open(path, specs) as store:
        ...     first = copy.group(store, 0)
        ...     again = copy.group(store, 0)            # no read, no check: the same bytes
        >>> first.data_ptr() == again.data_ptr(), first[:12].view(torch.float32).tolist()
        (True, [1.0, 1.0, 1.0])
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self._buffer: Optional[torch.Tensor] = None
        self._identity: Optional[tuple] = None
        self._offsets: list[int] = []
        self._ready: set[int] = set()

    def group(self, store: "WeightStore", k: int) -> torch.Tensor:
        """Group ``k`` of ``store`` in the host buffer, verified (raises ``WeightStoreError``
        naming a corrupt tensor)."""
        if store.identity != self._identity or not store.identity:
            sizes = [store.group_nbytes(j) for j in range(store.num_groups)]
            self._offsets = [0]
            for n in sizes:
                self._offsets.append(self._offsets[-1] + n)
            if self._buffer is None or self._buffer.numel() < self._offsets[-1]:
                self._buffer = host_buffer(self._offsets[-1], self.pin)
            self._identity, self._ready = store.identity, set()
        view = self._buffer[self._offsets[k]:self._offsets[k + 1]]
        if k not in self._ready:
            view.copy_(store.group_region(k))  # the one read from the file
            store.verify(k, view)
            self._ready.add(k)
        return view


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


def _tidal_metadata(path: Path, header: dict) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """The group byte ranges and the per-tensor checksums (64-bit word sums) from the header's
    metadata; raises ``WeightStoreError`` for a file tidal did not write or wrote in another
    format version."""
    meta = header.get("__metadata__")
    meta = meta if isinstance(meta, dict) else {}
    fmt = meta.get("tidal.format")
    if fmt is None or "tidal.groups" not in meta:
        raise WeightStoreError(f"weight store {path}: no tidal group table in its metadata "
                               "(not written by tidal's write_store)")
    if fmt in OLD_FORMATS:
        raise WeightStoreError(f"weight store {path} was written by an older tidal (format "
                               f"{fmt!r}, without checksums); rewrite it with "
                               "tidal.runtime.weights.loader.write_groups")
    if fmt != FORMAT:
        raise WeightStoreError(f"weight store {path} has format {fmt!r}, this tidal reads "
                               f"{FORMAT!r} (written by a newer tidal?)")
    try:
        ranges = [(int(b), int(e)) for b, e in json.loads(meta["tidal.groups"])]
        checksums = {str(k): int(v) for k, v in json.loads(meta["tidal.sum64"]).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise WeightStoreError(f"weight store {path}: damaged tidal metadata ({e!r}); rewrite "
                               "the store") from None
    return ranges, checksums


def _file_entries(path: Path, header: dict) -> dict[str, tuple[TensorSpec, int, int]]:
    """The stored tensors (padding left out) in data order: name to (spec, begin, end)."""
    entries = []
    for name, entry in header.items():
        if name == "__metadata__" or name.startswith("__pad__."):
            continue
        try:
            lo, hi = (int(x) for x in entry["data_offsets"])
            spec = TensorSpec(name, tuple(int(d) for d in entry["shape"]),
                              _CODES.get(entry["dtype"], entry["dtype"]))
        except (KeyError, TypeError, ValueError) as e:
            raise WeightStoreError(f"weight store {path}: tensor {name!r} has a malformed "
                                   f"header entry ({e!r})") from None
        entries.append((lo, name, spec, hi))
    return {name: (spec, lo, hi) for lo, name, spec, hi in sorted(entries)}


def _describe(spec: TensorSpec) -> str:
    return spec.describe() if isinstance(spec.dtype, torch.dtype) else \
        f"{spec.dtype}{list(spec.shape)}"


def _check_same_tensors(path: Path, entries: dict[str, tuple[TensorSpec, int, int]],
                        expected: Sequence[TensorSpec]) -> None:
    """Raise ``WeightStoreError`` naming the first expected tensor that the file lacks or holds
    with another shape or dtype, then the first stored tensor the model does not have."""
    stored = list(entries)
    for i, spec in enumerate(expected):
        if spec.name not in entries:
            there = ""
            if i < len(stored):
                there = (f"; the store has {stored[i]!r} "
                         f"{_describe(entries[stored[i]][0])} in its place")
            raise WeightStoreError(f"weight store {path}: tensor {spec.name!r} is missing "
                                   f"({spec.describe()} in the model{there}; file written for "
                                   "another model?)")
        have = entries[spec.name][0]
        if have != spec:
            raise WeightStoreError(f"weight store {path}: tensor {spec.name!r} is "
                                   f"{_describe(have)} in the file but {spec.describe()} in "
                                   "the model (file written for another model?)")
    wanted = {s.name for s in expected}
    extra = [n for n in stored if n not in wanted]
    if extra:
        raise WeightStoreError(f"weight store {path}: tensor {extra[0]!r} is not in the "
                               "model (file written for another model?)")


def _group_layout(path: Path, k: int, byte_range: tuple[int, int], group: Sequence[TensorSpec],
                  entries: dict[str, tuple[TensorSpec, int, int]], data_start: int,
                  size: int) -> list[tuple[TensorSpec, int]]:
    """Where each tensor of group ``k`` sits inside the group's buffer; raises
    ``WeightStoreError`` for a tensor outside the group, of the wrong size or truncated."""
    begin, end = byte_range
    layout = []
    for spec in group:
        _, lo, hi = entries[spec.name]
        if hi - lo != spec.nbytes:
            raise WeightStoreError(f"weight store {path}: tensor {spec.name!r} has "
                                   f"{hi - lo} bytes, expected {spec.nbytes}")
        if not (begin <= lo and hi <= end):
            raise WeightStoreError(f"weight store {path}: tensor {spec.name!r} is not in "
                                   f"group {k} (written for another grouping)")
        if data_start + hi > size:
            raise WeightStoreError(f"weight store {path} is truncated: tensor {spec.name!r} "
                                   f"needs bytes up to {data_start + hi}, the file has {size}")
        layout.append((spec, lo - begin))
    return layout
