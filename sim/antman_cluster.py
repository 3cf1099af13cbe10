"""AntMan's cluster scheduler on a model cluster: Algorithm 1, the local coordinator, job upgrade.

AntMan (Xiao et al., OSDI '20; ``../shared/seeds/antman-pipeswitch-slides.txt``) runs two kinds
of jobs on shared GPUs: *resource-guaranteed* jobs get whole GPUs and run as on dedicated ones;
*opportunistic* jobs run beside them on what they leave idle. The cluster here is ``nodes`` x
``gpus_per_node`` GPUs; each GPU holds at most one guaranteed job (its compute share and memory
in use) and any number of opportunistic ones, and may be reserved for one waiting job.

* :func:`schedule_job` is the slides' Algorithm 1 ``scheduleJob`` line by line: ``nodes0`` the
  GPUs found under the job's topology (free of guaranteed jobs and of other jobs'
  reservations), ``nodes1`` those found under the constraint M (enough free memory, compute
  load below 1), ``nodes2 = minLoadNodes(nodes1)``; a guaranteed job gets ``nodes0`` when they
  are enough, else they are reserved for it and it is not placed; an opportunistic job gets
  ``nodes2``. Ties go to the lowest GPU index (a global index, node-major).
* :func:`coordinate` is the local coordinator (GpuOpManager and Universal Memory): per GPU the
  guaranteed job keeps its compute share and memory; opportunistic jobs share the idle compute
  share and the memory left, the excess memory spilling to host memory at a stated slowdown.
* :func:`try_upgrade` is job upgrade: an opportunistic job becomes guaranteed when its GPUs are
  free of guaranteed jobs and of others' reservations and no guaranteed job waits.

Example (two nodes of two 32 GB GPUs; a guaranteed job holds GPU 0):
    >>> from tidal.sim.antman_cluster import Cluster, Job, schedule_job, coordinate
    >>> c = Cluster(nodes=2, gpus_per_node=2, memory_gb=32.0)
    >>> c.place(Job("g", gpus=1, share=0.6, memory_gb=20.0), (0,))
    >>> schedule_job(c, Job("big", gpus=2, share=0.9, memory_gb=8.0))  # node 1 is free
    (2, 3)
    >>> schedule_job(c, Job("big3", gpus=3, share=0.9, memory_gb=8.0, topo="any"))
    (1, 2, 3)
    >>> schedule_job(c, Job("o", gpus=1, share=0.5, memory_gb=14.0, guaranteed=False))
    (1,)
    >>> o = Job("o", gpus=1, share=0.5, memory_gb=14.0, guaranteed=False)
    >>> c.place(o, (0,))                     # beside g: 0.4 of the GPU idle, 12 GB left
    >>> coordinate(c, {"o": o, "g": Job("g", share=0.6, memory_gb=20.0)})["o"]
    Share(rate=0.8, spilled_gb=2.0, limit='idle share')
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

TOPOLOGIES = ("node", "any")
"""``node``: all of a job's GPUs on one node; ``any``: anywhere (one node when one has room,
else the fewest nodes)."""


@dataclass(frozen=True)
class Job:
    """A training job: ``gpus`` GPUs under ``topo``, each kept busy a ``share`` (0, 1] of the
    time when it runs alone (per-iteration compute demand) and holding ``memory_gb``;
    ``iterations`` mini-batches of ``iteration_s`` each on dedicated GPUs, arriving at
    ``arrival_s``. ``guaranteed``: resource-guaranteed (has quota) or opportunistic."""

    name: str
    gpus: int = 1
    share: float = 1.0
    memory_gb: float = 1.0
    guaranteed: bool = True
    topo: str = "node"
    iterations: int = 1
    iteration_s: float = 1.0
    arrival_s: float = 0.0

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.iterations < 1:
            raise ValueError(f"job {self.name!r}: needs at least one GPU and one iteration")
        if not 0 < self.share <= 1:
            raise ValueError(f"job {self.name!r}: share={self.share!r} must be in (0, 1]")
        if self.memory_gb < 0 or not self.iteration_s > 0 or self.arrival_s < 0:
            raise ValueError(f"job {self.name!r}: memory, iteration time and arrival must be "
                             f"non-negative (iteration time positive)")
        if self.topo not in TOPOLOGIES:
            raise ValueError(f"job {self.name!r}: topo={self.topo!r} is not one of {TOPOLOGIES}")

    @property
    def duration_s(self) -> float:
        """Run time on dedicated GPUs."""
        return self.iterations * self.iteration_s


@dataclass
class Gpu:
    """One GPU's state: the guaranteed job on it (name, compute share, memory), the
    opportunistic jobs beside it (name -> (share, memory)) and the job it is reserved for."""

    memory_gb: float
    guaranteed: Optional[str] = None
    g_share: float = 0.0
    g_memory_gb: float = 0.0
    opportunistic: dict[str, tuple[float, float]] = field(default_factory=dict)
    reserved_for: Optional[str] = None
    load: float = 0.0
    """Compute demand placed on the GPU: the guaranteed share plus opportunistic shares."""
    free_memory_gb: float = 0.0
    """Memory neither the guaranteed nor the opportunistic jobs hold."""

    def __post_init__(self) -> None:
        self.update()

    def update(self) -> None:
        """Recompute ``load`` and ``free_memory_gb`` after the jobs on the GPU changed."""
        self.load = self.g_share + sum(s for s, _ in self.opportunistic.values())
        self.free_memory_gb = (self.memory_gb - self.g_memory_gb
                               - sum(m for _, m in self.opportunistic.values()))


class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs of ``memory_gb`` each; GPU ``i`` is on node
    ``i // gpus_per_node``."""

    def __init__(self, nodes: int, gpus_per_node: int, memory_gb: float = 32.0) -> None:
        if nodes < 1 or gpus_per_node < 1 or not memory_gb > 0:
            raise ValueError(f"Cluster(nodes={nodes}, gpus_per_node={gpus_per_node}, "
                             f"memory_gb={memory_gb}): need at least one GPU with memory")
        self.nodes, self.gpus_per_node, self.memory_gb = nodes, gpus_per_node, memory_gb
        self.gpus = [Gpu(memory_gb) for _ in range(nodes * gpus_per_node)]

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def node_gpus(self, node: int) -> range:
        return range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node)

    def check(self, job: Job) -> None:
        """Raise ``ValueError`` for a job this cluster can never run."""
        if job.gpus > len(self.gpus) or (job.topo == "node" and job.gpus > self.gpus_per_node):
            raise ValueError(f"job {job.name!r}: {job.gpus} GPUs ({job.topo}) do not fit "
                             f"{self.nodes} x {self.gpus_per_node} GPUs")
        if job.memory_gb > self.memory_gb:
            raise ValueError(f"job {job.name!r}: {job.memory_gb} GB per GPU exceeds a GPU's "
                             f"{self.memory_gb} GB")

    def place(self, job: Job, gpus: Sequence[int], guaranteed: Optional[bool] = None) -> None:
        """Put ``job`` on ``gpus``, as guaranteed or opportunistic (default: ``job``'s kind);
        reservations for it are released."""
        as_g = job.guaranteed if guaranteed is None else guaranteed
        for i in gpus:
            g = self.gpus[i]
            if as_g:
                if g.guaranteed is not None:
                    raise ValueError(f"GPU {i} already runs guaranteed job {g.guaranteed!r}")
                g.guaranteed, g.g_share, g.g_memory_gb = job.name, job.share, job.memory_gb
            else:
                g.opportunistic[job.name] = (job.share, job.memory_gb)
            g.update()
        self.unreserve(job.name)

    def remove(self, name: str) -> None:
        """Take job ``name`` off every GPU (it finished or is being upgraded)."""
        for g in self.gpus:
            if g.guaranteed == name or name in g.opportunistic:
                if g.guaranteed == name:
                    g.guaranteed, g.g_share, g.g_memory_gb = None, 0.0, 0.0
                g.opportunistic.pop(name, None)
                g.update()

    def reserve(self, name: str, gpus: Sequence[int]) -> None:
        for i in gpus:
            self.gpus[i].reserved_for = name

    def unreserve(self, name: Optional[str] = None) -> None:
        """Release the reservations of job ``name`` (all reservations when None)."""
        for g in self.gpus:
            if name is None or g.reserved_for == name:
                g.reserved_for = None

    def gpus_of(self, name: str) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.gpus)
                     if g.guaranteed == name or name in g.opportunistic)


def _free_for(cluster: Cluster, name: str) -> list[int]:
    """GPUs a guaranteed job ``name`` may take: no guaranteed job, not reserved for another."""
    return [i for i, g in enumerate(cluster.gpus)
            if g.guaranteed is None and g.reserved_for in (None, name)]


def find_nodes_topo(cluster: Cluster, job: Job) -> tuple[int, ...]:
    """Algorithm 1 line 1, ``findNodes(job.gpu, constraints <- job.topo)``: up to ``job.gpus``
    GPUs free for the job. When one node has enough, the node with the fewest free GPUs that
    still holds the job (best fit: whole nodes stay whole for larger jobs); otherwise, under
    ``node`` the free GPUs of the node with the most, under ``any`` GPUs from the nodes with the
    most free first. Within a node, GPUs with less opportunistic load first; ties to the lowest
    index throughout. Fewer than ``job.gpus`` GPUs means the job does not fit now."""
    free = set(_free_for(cluster, job.name))
    per_node = [[i for i in cluster.node_gpus(n) if i in free] for n in range(cluster.nodes)]
    for ids in per_node:
        ids.sort(key=lambda i: (cluster.gpus[i].load, i))
    fits = [n for n in range(cluster.nodes) if len(per_node[n]) >= job.gpus]
    if fits:
        best = min(fits, key=lambda n: (len(per_node[n]), n))
        return tuple(sorted(per_node[best][:job.gpus]))
    order = sorted(range(cluster.nodes), key=lambda n: (-len(per_node[n]), n))
    if job.topo == "node":
        return tuple(sorted(per_node[order[0]]))
    picked = [i for n in order for i in per_node[n]]
    return tuple(sorted(picked[:job.gpus]))


def find_nodes_m(cluster: Cluster, job: Job) -> list[int]:
    """Algorithm 1 line 2, ``findNodes(job.gpu, constraints <- M)``: every GPU whose free memory
    holds the job and whose compute load is below 1 (some idle share left), in index order."""
    return [i for i, g in enumerate(cluster.gpus)
            if g.free_memory_gb >= job.memory_gb and g.load < 1.0
            and job.name not in g.opportunistic and g.guaranteed != job.name]


def min_load_nodes(cluster: Cluster, candidates: Sequence[int], n: int) -> tuple[int, ...]:
    """Algorithm 1 line 3, ``minLoadNodes``: the ``n`` least-loaded candidates (ties to the
    lowest index), or ``()`` when there are fewer than ``n``."""
    if len(candidates) < n:
        return ()
    return tuple(sorted(sorted(candidates, key=lambda i: (cluster.gpus[i].load, i))[:n]))


def schedule_job(cluster: Cluster, job: Job, guaranteed: Optional[bool] = None) -> tuple[int, ...]:
    """Algorithm 1 ``scheduleJob(job) -> nodes``: the GPUs to start ``job`` on, or ``()``.
    A guaranteed job (``guaranteed`` overrides the job's kind) that does not fit reserves the
    GPUs found under its topology (other guaranteed jobs may not take them; opportunistic jobs
    may run there until it starts) and returns ``()``. The cluster is not changed otherwise:
    the caller places the job."""
    nodes0 = find_nodes_topo(cluster, job)
    nodes1 = find_nodes_m(cluster, job)
    nodes2 = min_load_nodes(cluster, nodes1, job.gpus)
    if job.guaranteed if guaranteed is None else guaranteed:
        if len(nodes0) >= job.gpus:
            return nodes0
        cluster.reserve(job.name, nodes0)
        return ()
    return nodes2


def topology_holds(cluster: Cluster, job: Job, gpus: Sequence[int]) -> bool:
    """Whether ``gpus`` satisfy ``job.topo``."""
    return job.topo == "any" or len({cluster.node_of(i) for i in gpus}) == 1


def try_upgrade(cluster: Cluster, job: Job, guaranteed_waiting: bool) -> bool:
    """Job upgrade: make the running opportunistic ``job`` guaranteed on its GPUs when every one
    of them is free of guaranteed jobs and of other jobs' reservations, its placement satisfies
    its topology, and no guaranteed job waits (``guaranteed_waiting``). Returns whether it did."""
    gpus = cluster.gpus_of(job.name)
    if guaranteed_waiting or not gpus or not topology_holds(cluster, job, gpus):
        return False
    if any(cluster.gpus[i].guaranteed is not None
           or cluster.gpus[i].reserved_for not in (None, job.name) for i in gpus):
        return False
    cluster.remove(job.name)
    cluster.place(job, gpus, guaranteed=True)
    return True


@dataclass(frozen=True)
class Share:
    """What the local coordinator gives a job for the next interval: ``rate``, its speed as a
    fraction of its dedicated speed; ``spilled_gb``, its memory beyond what the guaranteed job
    leaves, held in host memory (the most on any of its GPUs); ``limit``, what bounds ``rate``:
    ``"dedicated"`` (nothing: a guaranteed job, or an opportunistic one with enough idle share),
    ``"interference"`` (a guaranteed job sharing its GPUs), ``"idle share"`` or
    ``"host memory"``."""

    rate: float
    spilled_gb: float = 0.0
    limit: str = "dedicated"


def _spill(cluster: Cluster, jobs: Mapping[str, Job]) -> dict[str, float]:
    """Per opportunistic job, the most GB it spills on any of its GPUs: on a GPU where the
    opportunistic jobs hold more than the guaranteed job leaves, each keeps the same fraction
    of its memory on the GPU (Universal Memory caps), the rest goes to host memory."""
    out: dict[str, float] = {}
    for g in cluster.gpus:
        held = sum(m for _, m in g.opportunistic.values())
        left = max(0.0, g.memory_gb - g.g_memory_gb)
        over = max(0.0, held - left)
        for name, (_, m) in g.opportunistic.items():
            out[name] = max(out.get(name, 0.0), m * over / held if over else 0.0)
    return out


def coordinate(cluster: Cluster, jobs: Mapping[str, Job], interference: float = 0.0,
               spill_penalty: float = 1.0) -> dict[str, Share]:
    """The local coordinator for one interval: the :class:`Share` of every job on the cluster
    (``jobs``: name -> job, covering all of them).

    A guaranteed job runs at dedicated speed, slowed by ``interference`` (a fraction) while an
    opportunistic job shares any of its GPUs. Opportunistic jobs fill the idle share
    ``1 - guaranteed share`` of each GPU like GpuOpManager distributing idle slots: their speeds
    rise together (progressive filling, max-min fair in the fraction of dedicated speed; a
    multi-GPU job uses ``share x speed`` on each of its GPUs) until a GPU is full or a job
    reaches its ceiling ``1 / (1 + spill_penalty x spilled fraction of its memory)``, the
    slowdown of a job whose excess memory lives in host memory."""
    if interference < 0 or spill_penalty < 0:
        raise ValueError("coordinate: interference and spill_penalty must be >= 0")
    spilled = _spill(cluster, jobs)
    opp = sorted(spilled)
    ceiling = {n: 1.0 / (1.0 + spill_penalty * (spilled[n] / jobs[n].memory_gb
                                                if jobs[n].memory_gb else 0.0)) for n in opp}
    speed = {n: 0.0 for n in opp}
    limit = {n: "dedicated" for n in opp}
    active = set(opp)
    used = [g.g_share for g in cluster.gpus]
    while active:
        step = min(ceiling[n] - speed[n] for n in active)
        for i, g in enumerate(cluster.gpus):
            demand = sum(s for n, (s, _) in g.opportunistic.items() if n in active)
            if demand > 0:
                step = min(step, max(0.0, 1.0 - used[i]) / demand)
        for n in active:
            speed[n] += step
        for i, g in enumerate(cluster.gpus):
            used[i] += step * sum(s for n, (s, _) in g.opportunistic.items() if n in active)
        full = [cluster.gpus[i] for i in range(len(used)) if used[i] >= 1.0 - 1e-12]
        for n in sorted(active):
            if speed[n] >= ceiling[n] - 1e-12:
                limit[n] = "host memory" if ceiling[n] < 1.0 else "dedicated"
            elif any(n in g.opportunistic for g in full):
                limit[n] = "idle share"
            else:
                continue
            active.discard(n)
    out = {n: Share(speed[n], spilled[n], limit[n]) for n in opp}
    shared = {g.guaranteed for g in cluster.gpus if g.guaranteed is not None and g.opportunistic}
    for g in cluster.gpus:
        if g.guaranteed is not None and g.guaranteed not in out:
            out[g.guaranteed] = (Share(1.0 / (1.0 + interference), 0.0, "interference")
                                 if g.guaranteed in shared and interference else Share(1.0))
    return out


def busy(cluster: Cluster, shares: Mapping[str, Share]) -> list[float]:
    """Per GPU, the fraction of the interval its compute is busy: the guaranteed job's share
    plus each opportunistic job's share times its speed (capped at 1)."""
    return [min(1.0, g.g_share + sum(s * shares[n].rate for n, (s, _) in g.opportunistic.items()))
            for g in cluster.gpus]
