"""Host-side weight store: a safetensors file laid out in layer groups, written atomically and
read with checked reads.

File layout (a valid safetensors file, readable by the ``safetensors`` package):

* 8 bytes little-endian header length, then the JSON header padded with spaces so that the
  data starts at a multiple of 512 bytes;
* the data: group after group, each group one contiguous buffer starting on a 512-byte block
  and padded to a whole number of blocks (PipeSwitch's transfer unit); inside a group each
  tensor starts on a 64-byte boundary. Padding is written as ``uint8`` tensors named
  ``__pad__.<n>`` because safetensors allows no holes between tensors;
* ``__metadata__``: ``tidal.format`` (the format version, :data:`FORMAT`), ``tidal.groups``
  (JSON list of ``[begin, end)`` byte ranges of the groups, relative to the data start) and
  ``tidal.crc32`` (JSON object: the :func:`checksum`, a CRC-32, of each tensor's bytes).

:func:`write_store` writes atomically: a temporary file in the same directory, flushed to the
disk (``fsync``), renamed onto the path (``os.replace``), then the directory synced. A crash or
an error mid-write leaves the previous store whole, and a reader that has the old file open
keeps reading the old bytes (the path names a new file; the old one lives while it is open).

:meth:`WeightStore.open` validates the file against what the model expects *before* anything
runs: a missing file, a directory, a truncated file, a header whose offsets point outside the
file (a tensor or a group past its end), a store written by an older tidal (formats
``tidal-layer-groups-1``, no checksums, and ``tidal-layer-groups-2``, word sums that miss
swapped words: refused, rewrite it) or a file of another model (a tensor missing, or with
another shape, dtype or group) raises :class:`WeightStoreError` naming the path and the first
mismatching tensor or group; the tensors are compared before the group count, so a store of
another model names the first tensor that differs.

The store is read with ordinary reads (``readinto`` into the caller's buffer), not a memory
map: a mapped file truncated or rewritten in place by another process kills the reader with
``SIGBUS`` when it touches the lost pages, which Python cannot catch, while a read past the end
just returns fewer bytes, which :meth:`WeightStore.read_group` reports as a
:class:`WeightStoreError` naming the path and the group. The copy costs nothing extra: the
loader copies the bytes out of the file anyway. The data itself is checked as it is read:
:meth:`WeightStore.verify` runs one checksum pass over a group's bytes (the loader calls it on the
copy it reads out of the file, before the group's parameters point at anything made from it),
so bytes overwritten or reordered since the store was written (random bytes, NaNs, swapped
rows) raise
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
import os
import secrets
import stat
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional, Sequence, Union

import torch

from tidal.ir.errors import TidalError
from tidal.ir.meta import TensorInfo

BLOCK = 512
"""Group alignment and padding unit in bytes (PipeSwitch pads transfers to 512-byte blocks)."""
TENSOR_ALIGN = 64
"""Alignment of each tensor inside a group."""
FORMAT = "tidal-layer-groups-3"
"""Format version written in the metadata; version 2 added a checksum per tensor, version 3
made it a CRC-32 (``tidal.crc32``), which sees swapped words and rows."""
OLD_FORMATS = {
    "tidal-layer-groups-1": "without checksums",
    "tidal-layer-groups-2": "with 64-bit word-sum checksums, which miss swapped words and rows",
}
"""Formats of older tidal versions, with what they lack: refused with a message to rewrite the
store (:func:`tidal.runtime.weights.loader.write_groups`)."""

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
    """The checksum stored for a tensor: the CRC-32 (``zlib.crc32``) of its bytes (any
    contiguous buffer). It catches bytes overwritten (random bytes, NaNs, zeros, another
    model's weights) and bytes reordered (swapped words or rows, which a sum of words misses).
    ``zlib`` releases the GIL over large buffers, so a check on the load stream does not stall
    the compute stream; it is slower than a copy (about 1.5 GB/s per core with zlib 1.2).

    Example:
        >>> checksum(b"ab") != checksum(b"ba"), checksum(b"")
        (True, 0)
    """
    return zlib.crc32(data) & 0xFFFFFFFF


def _round_up(x: int, unit: int) -> int:
    return (x + unit - 1) // unit * unit


def _raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def write_store(path: PathLike, groups: Sequence[Sequence[tuple[str, torch.Tensor]]],
                metadata: dict[str, str] | None = None) -> None:
    """Write ``groups`` (each a list of ``(name, tensor)``) as a grouped safetensors file,
    atomically (see the module docstring): an error mid-write (a full disk, an interrupt)
    raises with the previous file at ``path``, if any, unchanged and no temporary file left;
    readers that have the previous file open keep reading it."""
    head, chunks, data_end = _serialize(groups, metadata)
    _write_atomically(Path(path), head, chunks, data_end)


def _serialize(groups: Sequence[Sequence[tuple[str, torch.Tensor]]],
               metadata: Optional[dict[str, str]]) -> tuple[bytes, list[tuple[int, bytes]], int]:
    """The file's header (length prefix and padded JSON), its data chunks as ``(offset in the
    data, bytes)`` and the data's length."""
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
            "tidal.crc32": json.dumps(checksums)}
    header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (_round_up(8 + len(text), BLOCK) - 8 - len(text))
    return struct.pack("<Q", len(text)) + text, chunks, offset


def _write_atomically(path: Path, head: bytes, chunks: Sequence[tuple[int, bytes]],
                      data_end: int) -> None:
    """Write the file under a temporary name next to ``path`` (created with the mode a plain
    ``open`` would give it), ``fsync`` it, rename it onto ``path``, ``fsync`` the directory."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = -1
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                     0o666)
        _write_at(fd, head, 0)
        for off, data in chunks:
            _write_at(fd, data, len(head) + off)
        os.ftruncate(fd, len(head) + data_end)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException as e:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise WeightStoreError(f"write_store: cannot write {path} ({e}); the previous "
                                   "file there, if any, is unchanged") from e
        raise
    _fsync_directory(path.parent)


def _write_at(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at byte ``offset`` of ``fd`` (a write may be short)."""
    view = memoryview(data)
    os.lseek(fd, offset, os.SEEK_SET)
    while view:
        view = view[os.write(fd, view):]


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable; best effort (not every platform opens
    directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    """An open, validated store: the open file and the location of every tensor.

    Open with :meth:`open`; ``read_group(k)`` reads group ``k``'s contiguous buffer out of the
    file, ``group_tensors(k)`` says where each tensor sits in it, and ``verify(k, buffer)``
    checks a copy of the group against the checksums in the header. The file stays open until
    :meth:`close`: a store replaced by :func:`write_store` meanwhile is still read from the
    file that was opened; one truncated or rewritten in place is reported by the reads.
    """

    def __init__(self, path: Path, file: BinaryIO, data_start: int,
                 layout: list[list[tuple[TensorSpec, int]]], ranges: list[tuple[int, int]],
                 checksums: dict[str, int], identity: tuple = ()):
        self.path = path
        self.identity = identity
        """(device, inode, size, modification time) of the file when it was opened: another
        value means other bytes."""
        self._file: Optional[BinaryIO] = file
        self._lock = threading.Lock()
        self._data_start = data_start
        self._layout = layout
        self._ranges = ranges
        self._checksums = checksums

    @classmethod
    def open(cls, path: PathLike, expected: Sequence[Sequence[TensorSpec]]) -> "WeightStore":
        """Open ``path`` and check it holds exactly the ``expected`` groups of tensors.
        Raises ``WeightStoreError`` naming the path and the first missing, mismatching or
        truncated tensor or group (the tensors are compared before the grouping, so a store
        of another model names the first tensor that differs), or saying the store was
        written by an older tidal or the path is not a file."""
        path = Path(path)
        file = _open_file(path)
        try:
            st = os.fstat(file.fileno())
            header, data_start = _read_header(path, file, st.st_size)
            ranges, checksums = _tidal_metadata(path, header)
            entries = _file_entries(path, header)
            _check_same_tensors(path, entries, [s for g in expected for s in g])
            if len(ranges) != len(expected):
                raise WeightStoreError(f"weight store {path} has {len(ranges)} groups, the "
                                       f"model's plan has {len(expected)} (written for "
                                       "another grouping)")
            data_size = st.st_size - data_start
            layout = [_group_layout(path, k, ranges[k], group, entries, data_size)
                      for k, group in enumerate(expected)]
            missing = [s.name for g in expected for s in g if s.name not in checksums]
            if missing:
                raise WeightStoreError(f"weight store {path}: no checksum for tensor "
                                       f"{missing[0]!r} in its header (damaged header); "
                                       "rewrite the store")
            _check_ranges(path, ranges, data_start, st.st_size)
        except BaseException:
            file.close()
            raise
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        return cls(path, file, data_start, layout, ranges, checksums, identity)

    def verify(self, k: int, buffer: torch.Tensor) -> None:
        """Check the tensors of group ``k`` in ``buffer`` (a ``uint8`` CPU tensor holding the
        group's bytes: :meth:`read_group`'s) against the checksums written with them: one
        :func:`checksum` pass over the bytes. Raises ``WeightStoreError`` naming the first
        tensor whose bytes changed since the store was written."""
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

    def read_group(self, k: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Read group ``k``'s contiguous buffer from the file into ``out`` (a contiguous
        ``uint8`` CPU tensor of :meth:`group_nbytes` bytes, e.g. pinned; a new one if None)
        and return it, unverified (:meth:`verify` checks it). Raises ``WeightStoreError``
        naming the path and the group if the file lost those bytes since it was opened
        (truncated or rewritten in place) or the store is closed."""
        begin, end = self._ranges[k]
        if out is None:
            out = torch.empty(end - begin, dtype=torch.uint8)
        self._read_into(out, self._data_start + begin, f"group {k}")
        return out

    def group_tensors(self, k: int) -> list[tuple[TensorSpec, int]]:
        """The tensors of group ``k`` with their byte offsets inside its buffer."""
        return list(self._layout[k])

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read from the file and verified (for inspection and tests)."""
        for k, entries in enumerate(self._layout):
            for spec, off in entries:
                if spec.name == name:
                    raw = torch.empty(spec.nbytes, dtype=torch.uint8)
                    self._read_into(raw, self._data_start + self._ranges[k][0] + off,
                                    f"tensor {name!r} (group {k})")
                    self._verify_one(k, spec, raw)
                    return view_tensor(raw, spec, 0)
        raise KeyError(name)

    def _read_into(self, out: torch.Tensor, offset: int, what: str) -> None:
        """Fill ``out`` with the file's bytes from ``offset``; ``what`` names them in errors."""
        if out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"weight store {self.path}: {what} must be read into a "
                             f"contiguous uint8 CPU tensor, got {out.dtype} on {out.device}")
        view = memoryview(out.numpy())
        with self._lock:
            if self._file is None:
                raise WeightStoreError(f"weight store {self.path} is closed: {what} cannot "
                                       "be read; open it again")
            try:
                got = _read_at(self._file, view, offset)
                size = os.fstat(self._file.fileno()).st_size
            except OSError as e:
                raise WeightStoreError(f"weight store {self.path}: reading {what} failed "
                                       f"({e})") from e
        if got < len(view):
            raise WeightStoreError(
                f"weight store {self.path}: {what} (bytes {offset} to {offset + len(view)}) "
                f"is past the end of the file, which has {size} bytes: it was truncated or "
                "rewritten in place since it was opened; rewrite it with write_store (which "
                "replaces the file atomically) and open it again")

    def close(self) -> None:
        """Close the file (tensors read from it stay valid)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

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
            store.read_group(k, view)  # the one read from the file
            store.verify(k, view)
            self._ready.add(k)
        return view


def view_tensor(buffer: torch.Tensor, spec: TensorSpec, offset: int) -> torch.Tensor:
    """The tensor ``spec`` at byte ``offset`` of a ``uint8`` group buffer, as a view."""
    raw = buffer[offset:offset + spec.nbytes]
    return raw.view(spec.dtype).reshape(spec.shape)


def _open_file(path: Path) -> BinaryIO:
    """``path`` opened for unbuffered binary reads; ``WeightStoreError`` for a path that does
    not exist, is a directory or another non-regular file, or cannot be opened."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise WeightStoreError(f"weight store {path} does not exist") from None
    except OSError as e:
        raise WeightStoreError(f"weight store {path} cannot be read ({e})") from None
    if stat.S_ISDIR(mode):
        raise WeightStoreError(f"weight store {path} is a directory, not a store file; pass "
                               "the path of the file write_groups wrote")
    if not stat.S_ISREG(mode):
        raise WeightStoreError(f"weight store {path} is not a regular file")
    try:
        return open(path, "rb", buffering=0)
    except OSError as e:  # replaced by a directory, permissions, ...
        raise WeightStoreError(f"weight store {path} cannot be opened ({e})") from None


def _read_at(file: BinaryIO, view: memoryview, offset: int) -> int:
    """Read into ``view`` from byte ``offset`` of ``file`` until it is full or the file
    ends; the number of bytes read (a single read may be short)."""
    file.seek(offset)
    got = 0
    while got < len(view):
        n = file.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _read_header(path: Path, file: BinaryIO, size: int) -> tuple[dict, int]:
    """The JSON header of the open store and where its data starts."""
    head = bytearray(8)
    if _read_at(file, memoryview(head), 0) < 8:
        raise WeightStoreError(f"weight store {path} is truncated: {size} bytes, no header")
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
        raise WeightStoreError(f"weight store {path} is truncated: header needs {8 + n} "
                               f"bytes, the file has {size}")
    text = bytearray(n)
    if _read_at(file, memoryview(text), 8) < n:
        raise WeightStoreError(f"weight store {path} is truncated: header needs {8 + n} "
                               "bytes, the file is shorter")
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise WeightStoreError(f"weight store {path}: header is not valid JSON ({e})") \
            from None
    if not isinstance(header, dict):
        raise WeightStoreError(f"weight store {path}: header is not a JSON object")
    return header, 8 + n


def _tidal_metadata(path: Path, header: dict) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """The group byte ranges and the per-tensor checksums (CRC-32) from the header's metadata;
    raises ``WeightStoreError`` for a file tidal did not write or wrote in another format
    version."""
    meta = header.get("__metadata__")
    meta = meta if isinstance(meta, dict) else {}
    fmt = meta.get("tidal.format")
    if fmt is None or "tidal.groups" not in meta:
        raise WeightStoreError(f"weight store {path}: no tidal group table in its metadata "
                               "(not written by tidal's write_store)")
    if fmt in OLD_FORMATS:
        raise WeightStoreError(f"weight store {path} was written by an older tidal (format "
                               f"{fmt!r}, {OLD_FORMATS[fmt]}); rewrite it with "
                               "tidal.runtime.weights.loader.write_groups")
    if fmt != FORMAT:
        raise WeightStoreError(f"weight store {path} has format {fmt!r}, this tidal reads "
                               f"{FORMAT!r} (written by a newer tidal?)")
    try:
        ranges = [(int(b), int(e)) for b, e in json.loads(meta["tidal.groups"])]
        checksums = {str(k): int(v) for k, v in json.loads(meta["tidal.crc32"]).items()}
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
                  entries: dict[str, tuple[TensorSpec, int, int]],
                  data_size: int) -> list[tuple[TensorSpec, int]]:
    """Where each tensor of group ``k`` sits inside the group's buffer; raises
    ``WeightStoreError`` for a tensor outside the file's ``data_size`` data bytes (truncated
    file or damaged header), of the wrong size, or outside the group."""
    begin, end = byte_range
    layout = []
    for spec in group:
        _, lo, hi = entries[spec.name]
        if not 0 <= lo <= hi:
            raise WeightStoreError(f"weight store {path}: tensor {spec.name!r} (group {k}) has "
                                   f"data offsets [{lo}, {hi}] (damaged header); rewrite the "
                                   "store")
        if hi > data_size:
            raise WeightStoreError(f"weight store {path} is truncated: tensor {spec.name!r} "
                                   f"needs bytes up to {hi} of the data (group {k}), the file "
                                   f"has {data_size} (or its header is damaged: an offset "
                                   "outside the file); rewrite the store")
        if hi - lo != spec.nbytes:
            raise WeightStoreError(f"weight store {path}: tensor {spec.name!r} has "
                                   f"{hi - lo} bytes, expected {spec.nbytes}")
        if not (begin <= lo and hi <= end):
            raise WeightStoreError(f"weight store {path}: tensor {spec.name!r} is not in "
                                   f"group {k} (written for another grouping)")
        layout.append((spec, lo - begin))
    return layout


def _check_ranges(path: Path, ranges: Sequence[tuple[int, int]], data_start: int,
                  size: int) -> None:
    """Raise ``WeightStoreError`` naming the first group whose byte range is empty, out of
    order (overlapping the one before) or past the end of the file."""
    previous_end = 0
    for k, (begin, end) in enumerate(ranges):
        if not previous_end <= begin < end:
            raise WeightStoreError(f"weight store {path}: group {k} has byte range [{begin}, "
                                   f"{end}), empty or overlapping group {k - 1} (damaged "
                                   "header); rewrite the store")
        if data_start + end > size:
            raise WeightStoreError(f"weight store {path} is truncated: group {k} ends at "
                                   f"byte {data_start + end}, past the end of the file "
                                   f"({size} bytes)")
        previous_end = end
