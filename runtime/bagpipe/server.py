"""Bagpipe's embedding server: tables sharded by row across ``S`` servers (id ``i`` lives on
server ``i % S`` at local row ``i // S``), read by ``fetch`` and updated by ``write``.

Trainers call a server through an RRef (``rref.rpc_async().fetch(table, ids)``); the helpers
:func:`shard_of`, :func:`split_by_server` and :func:`merge_rows` route ids and reassemble rows.

Example:
    >>> import torch
    >>> w = torch.arange(10.0).reshape(5, 2)
    >>> s1 = EmbeddingServer(1, 2, {"t": w})        # rows 1 and 3
    >>> s1.fetch("t", torch.tensor([3, 1])).tolist()
    [[6.0, 7.0], [2.0, 3.0]]
    >>> s1.write("t", torch.tensor([3]), torch.tensor([[0.0, 0.0]]))
    >>> s1.shard("t").tolist()
    [[2.0, 3.0], [0.0, 0.0]]
    >>> [ids.tolist() for ids in split_by_server(torch.tensor([4, 1, 3, 0]), 2)]
    [[4, 0], [1, 3]]
"""
from __future__ import annotations

import threading
from typing import Mapping, Sequence

import torch

__all__ = ["EmbeddingServer", "shard_of", "split_by_server", "merge_rows", "assemble"]


def shard_of(weight: torch.Tensor, server: int, servers: int) -> torch.Tensor:
    """Rows of the full table ``weight`` held by ``server`` of ``servers`` (ids ``% S``)."""
    return weight[server::servers].clone()


def split_by_server(ids: torch.Tensor, servers: int) -> list[torch.Tensor]:
    """``ids`` grouped by the server that holds them (order kept within each group)."""
    return [ids[ids % servers == s] for s in range(servers)]


def merge_rows(ids: torch.Tensor, parts: Sequence[torch.Tensor], servers: int,
               dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of ``ids`` from the per-server answers to ``split_by_server(ids, servers)``
    (``None`` for a server that was asked nothing)."""
    out = torch.empty(len(ids), dim, dtype=dtype)
    for s, rows in enumerate(parts):
        if rows is not None:
            out[ids % servers == s] = rows
    return out


def assemble(shards: Sequence[torch.Tensor], num_rows: int) -> torch.Tensor:
    """The full table from every server's shard (inverse of :func:`shard_of`)."""
    first = shards[0]
    out = torch.empty(num_rows, first.shape[1], dtype=first.dtype)
    for s, rows in enumerate(shards):
        out[s::len(shards)] = rows
    return out


class EmbeddingServer:
    """Server ``server`` of ``servers``: its shard of every table of ``weights`` (full tables,
    name -> ``[num_rows, dim]``). Thread safe (RPC calls run on a thread pool)."""

    def __init__(self, server: int, servers: int, weights: Mapping[str, torch.Tensor]):
        self.server = server
        self.servers = servers
        self._tables = {n: shard_of(w.detach(), server, servers) for n, w in weights.items()}
        self._lock = threading.Lock()

    def _local(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        if table not in self._tables:
            raise KeyError(f"bagpipe server {self.server}: no table {table!r} (has "
                           f"{', '.join(self._tables)})")
        ids = ids.to(torch.int64)
        if ids.numel() and bool((ids % self.servers != self.server).any()):
            raise ValueError(f"bagpipe server {self.server}: table {table!r} got ids held by "
                             f"another server")
        return ids // self.servers

    def fetch(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (all held by this server)."""
        local = self._local(table, ids)
        with self._lock:
            return self._tables[table][local].clone()

    def write(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Store the rows of ``ids`` (a write-back of evicted cache rows)."""
        local = self._local(table, ids)
        with self._lock:
            self._tables[table][local] = rows.to(self._tables[table].dtype)

    def shard(self, table: str) -> torch.Tensor:
        """This server's shard of ``table`` (a copy)."""
        with self._lock:
            return self._tables[table].clone()

    def shards(self) -> dict[str, torch.Tensor]:
        """Copies of every table's shard."""
        with self._lock:
            return {n: t.clone() for n, t in self._tables.items()}
