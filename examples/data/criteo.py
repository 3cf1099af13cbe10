"""Batches from Criteo-format click logs (tab-separated text, one sample a line).

Each line holds 40 tab-separated fields: the 0/1 label, 13 integer features and 26 categorical
features written as hexadecimal strings (the Kaggle Display Advertising Challenge and Terabyte
layout). Any feature field may be empty. As in DLRM's preprocessing:

- integer feature ``x`` -> ``log(1 + max(x, 0))`` (empty -> 0);
- categorical value ``v`` in column ``t`` -> ``int(v, 16) % table_rows[t]`` (empty -> 0).

The file is scanned once when opened (recording where each batch starts); ``batch(i)`` then
reads and parses only its own lines, so files larger than memory work. Malformed lines raise a
ValueError naming the file and the line number when their batch is read.

Example:
    >>> import tempfile, os
    >>> from examples.data.criteo import CriteoTSV
    >>> line = "\\t".join(["1", "5", "", "-3"] + ["0"] * 10 + ["68fd1e64", ""] + ["a"] * 24)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = os.path.join(tmp, "day_0.tsv")
    ...     with open(path, "w") as f:
    ...         _ = f.write(line + "\\n" + line.replace("1", "0", 1) + "\\n")
    ...     data = CriteoTSV(path, table_rows=(1000,) * 26, batch_size=2)
    ...     (dense, sparse), labels = data.batch(0)
    >>> len(data), dense.shape, sparse.shape, labels.tolist()
    (1, torch.Size([2, 13]), torch.Size([2, 26]), [1.0, 0.0])
    >>> [round(v, 4) for v in dense[0, :3].tolist()], sparse[0, :3].tolist()
    ([1.7918, 0.0, 0.0], [852, 0, 10])
"""

from __future__ import annotations

import os
from typing import Sequence, Union

import torch
from torch import Tensor

NUM_DENSE = 13
"""Integer features per Criteo line."""

NUM_CATEGORICAL = 26
"""Categorical (hexadecimal) features per Criteo line."""

NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL
"""Tab-separated fields per line: label, integer features, categorical features."""


class CriteoTSV:
    """Random access to the batches of a Criteo-format TSV file.

    Args:
        path: the TSV file (no header line).
        table_rows: rows of each of the 26 embedding tables (categorical values are taken mod
            these).
        batch_size: samples per batch; the last batch may be shorter.
    """

    def __init__(self, path: Union[str, os.PathLike], table_rows: Sequence[int],
                 batch_size: int) -> None:
        self.path = os.fspath(path)
        if len(table_rows) != NUM_CATEGORICAL:
            raise ValueError(f"CriteoTSV: table_rows must have {NUM_CATEGORICAL} entries (one per "
                             f"categorical feature), got {len(table_rows)}")
        for t, rows in enumerate(table_rows):
            if int(rows) < 1:
                raise ValueError(f"CriteoTSV: table_rows[{t}] must be >= 1, got {rows}")
        if batch_size < 1:
            raise ValueError(f"CriteoTSV: batch_size must be >= 1, got {batch_size}")
        self.table_rows = tuple(int(r) for r in table_rows)
        self.batch_size = int(batch_size)
        self.num_dense = NUM_DENSE
        self._starts, self.num_samples = self._scan()

    def _scan(self) -> tuple[tuple[int, ...], int]:
        """Byte offsets of the first line of every batch, and the number of lines."""
        starts, offset, count = [], 0, 0
        with open(self.path, "rb") as f:
            for line in f:
                if count % self.batch_size == 0:
                    starts.append(offset)
                offset += len(line)
                count += 1
        return tuple(starts), count

    def __len__(self) -> int:
        """Number of batches (the last one may be shorter than ``batch_size``)."""
        return len(self._starts)

    @property
    def num_tables(self) -> int:
        """Number of categorical features (26)."""
        return NUM_CATEGORICAL

    def batch(self, i: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """Batch ``i`` as ``((dense, sparse), labels)``: float32 ``[B, 13]``, int64 ``[B, 26]``
        and float32 0/1 ``[B]``, from lines ``i * batch_size + 1`` onwards."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self):
            raise IndexError(f"CriteoTSV({self.path}): batch {i!r} out of range; the file has "
                             f"{len(self)} batches of up to {self.batch_size} lines")
        first = i * self.batch_size
        count = min(self.batch_size, self.num_samples - first)
        labels, dense, sparse = [], [], []
        with open(self.path, "rb") as f:
            f.seek(self._starts[i])
            for k in range(count):
                label, counts, ids = self._parse(f.readline(), first + k + 1)
                labels.append(label)
                dense.append(counts)
                sparse.append(ids)
        dense_t = torch.tensor(dense, dtype=torch.float64).clamp_(min=0).log1p_().float()
        return (dense_t, torch.tensor(sparse, dtype=torch.int64)), torch.tensor(
            labels, dtype=torch.float32)

    def _parse(self, raw: bytes, line_no: int) -> tuple[float, list[int], list[int]]:
        """One line -> (label, 13 integer counts, 26 table ids); ValueError names file:line."""
        where = f"{self.path}:{line_no}"
        try:
            text = raw.decode("ascii").rstrip("\r\n")
        except UnicodeDecodeError:
            raise ValueError(f"CriteoTSV: {where}: line is not ASCII text") from None
        fields = text.split("\t")
        if len(fields) != NUM_FIELDS:
            raise ValueError(f"CriteoTSV: {where}: expected {NUM_FIELDS} tab-separated fields "
                             f"(label, {NUM_DENSE} integer, {NUM_CATEGORICAL} categorical), "
                             f"got {len(fields)}")
        if fields[0] not in ("0", "1"):
            raise ValueError(f"CriteoTSV: {where}: label must be 0 or 1, got {fields[0]!r}")
        counts = [_integer(v, where, 2 + j) for j, v in enumerate(fields[1:1 + NUM_DENSE])]
        ids = [_category(v, rows, where, 2 + NUM_DENSE + t)
               for t, (v, rows) in enumerate(zip(fields[1 + NUM_DENSE:], self.table_rows))]
        return float(fields[0]), counts, ids


def _integer(value: str, where: str, column: int) -> int:
    """An integer feature (empty -> 0); ValueError names the file, line and field (1-based)."""
    if not value:
        return 0
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"CriteoTSV: {where}: field {column} must be an integer, "
                         f"got {value!r}") from None


def _category(value: str, rows: int, where: str, column: int) -> int:
    """A hexadecimal categorical value mod ``rows`` (empty -> 0); ValueError as :func:`_integer`."""
    if not value:
        return 0
    try:
        return int(value, 16) % rows
    except ValueError:
        raise ValueError(f"CriteoTSV: {where}: field {column} must be hexadecimal, "
                         f"got {value!r}") from None

