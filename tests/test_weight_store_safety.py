"""Weight stores under bad files and failing writes (issue 35, item 3): every failure is a
``WeightStoreError`` naming the path and the tensor or group; a store truncated or rewritten
while a reader has it open never kills the reader (``SIGBUS``); a write interrupted midway
leaves the previous store whole; the per-tensor checksum sees swapped rows."""
from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from tidal.runtime.weights.store import (HostCopy, TensorSpec, WeightStore, WeightStoreError,
                                         write_store)


def _groups(scale: float = 1.0):
    """Three groups of small tensors (group 1 holds one 32x8 float tensor, 32-byte rows)."""
    g = torch.Generator().manual_seed(0)
    return [[("a", torch.randn(8, 16, generator=g) * scale), ("b", torch.randn(16, generator=g))],
            [("c", torch.randn(32, 8, generator=g) * scale)],
            [("d", torch.arange(10, dtype=torch.float32) * scale)]]


def _specs(groups):
    return [[TensorSpec.of(name, t) for name, t in group] for group in groups]


def _header(path):
    """The store's JSON header, its length and where the data starts."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), n, 8 + n


def _rewrite_header(path, change):
    """Apply ``change`` to the header in place, keeping its length (padded with spaces)."""
    header, n, _ = _header(path)
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(text + b" " * (n - len(text)))


def _truncate_in_group_1(path):
    _, _, start = _header(path)
    lo, _ = _header(path)[0]["c"]["data_offsets"]
    os.truncate(path, start + lo + 40)


def _offset_outside(path):
    _rewrite_header(path, lambda h: h["d"].update(data_offsets=[10**9, 10**9 + 40]))


def _group_past_end(path):
    def stretch(h):
        ranges = json.loads(h["__metadata__"]["tidal.groups"])
        ranges[0][1] = 10**9  # group 0 "ends" far past the file
        h["__metadata__"]["tidal.groups"] = json.dumps(ranges)
    _rewrite_header(path, stretch)


@pytest.mark.parametrize("damage, message", [
    (_truncate_in_group_1, r"is truncated: tensor 'c' needs bytes up to \d+ of the data "
                           r"\(group 1\)"),
    (_offset_outside, r"is truncated: tensor 'd' needs bytes up to 1000000040 of the data "
                      r"\(group 2\), the file has \d+ \(or its header is damaged: an offset "
                      r"outside the file\)"),
    (_group_past_end, r"is truncated: group 0 ends at byte \d+, past the end of the file"),
], ids=["truncated", "offset-outside-the-file", "group-past-the-end"])
def test_damaged_store_is_refused_at_open_naming_path_and_tensor_or_group(tmp_path, damage,
                                                                        message):
    path = tmp_path / "w.safetensors"
    groups = _groups()
    write_store(path, groups)
    damage(path)
    with pytest.raises(WeightStoreError, match=message) as info:
        with WeightStore.open(path, _specs(groups)) as store:
            for k in range(store.num_groups):  # before the fix: a raw ValueError here
                HostCopy(pin=False).group(store, k)
    assert str(path) in str(info.value)


def test_directory_missing_file_and_closed_store_are_named(tmp_path):
    specs = _specs(_groups())
    with pytest.raises(WeightStoreError, match=r"is a directory, not a store file") as info:
        WeightStore.open(tmp_path, specs)
    assert str(tmp_path) in str(info.value)
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(WeightStoreError, match=f"{missing} does not exist"):
        WeightStore.open(missing, specs)
    path = tmp_path / "w.safetensors"
    write_store(path, _groups())
    store = WeightStore.open(path, specs)
    store.close()
    with pytest.raises(WeightStoreError, match=r"is closed: group 1 cannot be read"):
        store.read_group(1)


def test_swapped_rows_are_seen_by_the_checksum(tmp_path):
    path = tmp_path / "w.safetensors"
    groups = _groups()
    write_store(path, groups)
    header, _, start = _header(path)
    lo, _ = header["c"]["data_offsets"]
    row = 8 * 4  # bytes of one row of c
    with open(path, "r+b") as f:  # swap rows 0 and 1 of c: the same words, another order
        f.seek(start + lo)
        first, second = f.read(row), f.read(row)
        assert first != second
        f.seek(start + lo)
        f.write(second + first)
    with WeightStore.open(path, _specs(groups)) as store:
        assert torch.equal(store.tensor("a"), groups[0][0][1])  # the other tensors load
        with pytest.raises(WeightStoreError, match=rf"{path}: tensor 'c' \(group 1\) does not "
                                                   "match the checksum"):
            store.tensor("c")
        with pytest.raises(WeightStoreError, match=r"tensor 'c' \(group 1\)"):
            HostCopy(pin=False).group(store, 1)


def test_replacing_an_open_store_leaves_its_reader_on_the_old_bytes(tmp_path):
    path = tmp_path / "w.safetensors"
    old, new = _groups(), _groups(scale=2.0)  # same layout and size, other values
    write_store(path, old)
    with WeightStore.open(path, _specs(old)) as store:
        write_store(path, new)
        copy = HostCopy(pin=False)
        view = copy.group(store, 1)  # read after the replacement: still the old file
        assert torch.equal(view[:32 * 8 * 4].view(torch.float32).reshape(32, 8), old[1][0][1])
    with WeightStore.open(path, _specs(new)) as store:
        assert torch.equal(store.tensor("c"), new[1][0][1])
        assert torch.equal(copy.group(store, 1)[:32 * 8 * 4].view(torch.float32).reshape(32, 8),
                           new[1][0][1])  # another file: the host copy reads it again
    plain = tmp_path / "plain"
    plain.write_bytes(b"")  # the mode an ordinary open gives (umask applied), not 0600
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "w.safetensors"]


@pytest.mark.parametrize("fault, raised", [(OSError(errno.ENOSPC, "No space left on device"),
                                            WeightStoreError),
                                           (KeyboardInterrupt(), KeyboardInterrupt)],
                         ids=["disk-full", "interrupt"])
def test_interrupted_write_leaves_the_previous_store_intact(tmp_path, monkeypatch, fault,
                                                            raised):
    path = tmp_path / "w.safetensors"
    old, new = _groups(), _groups(scale=2.0)
    write_store(path, old)
    before = path.read_bytes()
    real_write, calls, partial = os.write, [], []

    def failing_write(fd, data):
        calls.append(len(data))
        if len(calls) < 3:
            return real_write(fd, data)
        real_write(fd, bytes(data[:len(data) // 2]))  # part of the data lands, then it fails
        partial.extend(p.stat().st_size for p in tmp_path.iterdir() if p.name.endswith(".tmp"))
        raise fault

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(raised):
        write_store(path, new)
    monkeypatch.undo()
    assert len(partial) == 1 and partial[0] > 0  # it failed midway through a temporary file
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temporary left
    with WeightStore.open(path, _specs(old)) as store:
        assert torch.equal(store.tensor("c"), old[1][0][1])


_READER = textwrap.dedent("""
    import os, sys, torch
    from tidal.runtime.weights.store import (HostCopy, TensorSpec, WeightStore,
                                             WeightStoreError, write_store)
    path = sys.argv[1]
    groups = [[("a", torch.arange(4096.0))], [("b", torch.arange(8192.0))]]
    specs = [[TensorSpec.of(n, t) for n, t in g] for g in groups]
    write_store(path, groups)
    with WeightStore.open(path, specs) as store:  # replaced by a shorter store while open
        write_store(path, [[("z", torch.zeros(1))]])
        view = HostCopy(pin=False).group(store, 1)
        print("replaced: old bytes", torch.equal(view[:32768].view(torch.float32),
                                                 groups[1][0][1]), flush=True)
    write_store(path, groups)
    with WeightStore.open(path, specs) as store:  # truncated in place while open
        os.truncate(path, 1024)
        try:
            HostCopy(pin=False).group(store, 1)
            print("truncated: read", flush=True)
        except WeightStoreError as e:
            print("truncated:", e, flush=True)
""")


def test_a_store_truncated_or_replaced_under_a_reader_never_kills_it(tmp_path):
    path = tmp_path / "w.safetensors"
    done = subprocess.run([sys.executable, "-c", _READER, str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != -7, "the reader died of SIGBUS"
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "replaced: old bytes True"
    assert lines[1].startswith(f"truncated: weight store {path}: group 1 (bytes ")
    assert "is past the end of the file, which has 1024 bytes" in lines[1]
