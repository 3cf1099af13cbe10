"""AntMan on a synthetic job trace: a deterministic discrete-event run and its results.

:func:`run` replays a list of jobs on a :class:`~tidal.sim.antman_cluster.Cluster`. At every
event (an arrival or a completion) the scheduler makes one pass over the waiting jobs in arrival
order, each through Algorithm 1 (:func:`~tidal.sim.antman_cluster.schedule_job`; reservations
are recomputed in that order, so the earliest waiting job has first claim), then tries job
upgrade on the running opportunistic jobs, then the local coordinator
(:func:`~tidal.sim.antman_cluster.coordinate`) sets every job's speed until the next event.
Two modes:

* ``sharing=True`` (AntMan): jobs keep their kind; opportunistic jobs run beside guaranteed ones;
* ``sharing=False`` (the dedicated-GPU baseline): every job is treated as guaranteed, so every
  job waits for whole GPUs (first come, first served, with the same reservations).

GPU utilization is busy GPU-time over GPU-time from 0 to the last completion (a GPU is busy for
its guaranteed job's compute share plus what its opportunistic jobs run); the trace fixes the
work (up to interference), so it rises only as the makespan shrinks. The utilization of in-use
GPUs (busy GPU-time over the GPU-time of GPUs holding any job) is the slides' "low utilization
of in-use GPUs". The coordinator's interval is the time between two events: shares are constant
within it. Not modelled: tenants and quotas (a job's kind is given by the trace, and job
upgrade stands in for "quota permits" with "no guaranteed job waits"), turning long-queued
guaranteed jobs into opportunistic ones, and phases within a job (its share is constant).
:func:`synthetic_trace` draws a seeded trace shaped like the slides' observations;
:func:`table2_jobs` is the slides' two-job example (Table 1).

Example (one GPU; an opportunistic job runs when a guaranteed one arrives):
    >>> from tidal.sim.antman_cluster import Job
    >>> from tidal.sim.antman_trace import run
    >>> jobs = [Job("o", share=0.5, guaranteed=False, iterations=100, iteration_s=1.0),
    ...         Job("g", share=0.5, iterations=100, iteration_s=1.0, arrival_s=50.0)]
    >>> def show(result):
    ...     return ([(r.name, r.start_s, r.finish_s) for r in result.records],
    ...             round(result.utilization, 3), round(result.in_use_utilization, 3))
    >>> show(run(jobs, 1, 1, upgrade=False))  # g starts at once; o runs in the idle half
    ([('o', 0.0, 100.0), ('g', 50.0, 150.0)], 0.667, 0.667)
    >>> show(run(jobs, 1, 1, sharing=False))  # dedicated: g waits for the GPU
    ([('o', 0.0, 100.0), ('g', 100.0, 200.0)], 0.5, 0.5)
    >>> run(jobs, 1, 1).records[0].upgraded_s  # o found the GPU idle: upgraded at once
    0.0
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from tidal.sim.antman_cluster import Cluster, Job, busy, coordinate, schedule_job, try_upgrade

GPU_MEMORY_GB = 32.0
"""GPU memory assumed throughout (a 32 GB V100, the GPU of AntMan's evaluation era)."""


@dataclass(frozen=True)
class JobRecord:
    """One job's outcome: when it arrived, first ran and finished; the GPUs it started on;
    whether it was submitted as guaranteed, when it was upgraded (opportunistic jobs), the most
    memory it spilled to host, and whether (guaranteed) it ever shared a GPU with an
    opportunistic job."""

    name: str
    guaranteed: bool
    arrival_s: float
    start_s: float
    finish_s: float
    gpus: tuple[int, ...]
    upgraded_s: Optional[float] = None
    spilled_gb: float = 0.0
    shared: bool = False

    @property
    def jct_s(self) -> float:
        """Job completion time: arrival to finish."""
        return self.finish_s - self.arrival_s

    @property
    def queue_s(self) -> float:
        """Queueing delay: arrival to first run."""
        return self.start_s - self.arrival_s


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in (0, 100]); 0.0 for no values.

    >>> percentile([4.0, 1.0, 3.0, 2.0], 50), percentile([4.0, 1.0, 3.0, 2.0], 90)
    (2.0, 4.0)
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class RunResult:
    """A run's job records (in submission order), busy GPU-seconds, GPU count, makespan and
    GPU-seconds in use (a GPU holding any job)."""

    records: tuple[JobRecord, ...]
    busy_gpu_s: float
    gpus: int
    makespan_s: float
    in_use_gpu_s: float = 0.0

    @property
    def utilization(self) -> float:
        """Busy GPU-time / GPU-time over [0, makespan]."""
        return self.busy_gpu_s / (self.gpus * self.makespan_s) if self.makespan_s else 0.0

    @property
    def in_use_utilization(self) -> float:
        """Busy GPU-time / GPU-time of GPUs holding a job."""
        return self.busy_gpu_s / self.in_use_gpu_s if self.in_use_gpu_s else 0.0

    def select(self, guaranteed: Optional[bool] = True) -> list[JobRecord]:
        """Records of the jobs submitted as guaranteed (True), opportunistic (False) or all."""
        return [r for r in self.records if guaranteed is None or r.guaranteed == guaranteed]

    def stats(self, guaranteed: Optional[bool] = True) -> dict[str, float]:
        """Mean and p90 of JCT and queueing delay (seconds) over the selected jobs."""
        rs = self.select(guaranteed)
        jct, queue = [r.jct_s for r in rs], [r.queue_s for r in rs]
        return {"jct_mean": sum(jct) / len(jct) if jct else 0.0, "jct_p90": percentile(jct, 90),
                "queue_mean": sum(queue) / len(queue) if queue else 0.0,
                "queue_p90": percentile(queue, 90)}


@dataclass
class _Running:
    job: Job
    guaranteed: bool
    start_s: float
    gpus: tuple[int, ...]
    left: float
    upgraded_s: Optional[float] = None
    spilled_gb: float = 0.0
    shared: bool = False


def _schedule(cluster: Cluster, queue: list[Job], running: dict[str, _Running], now: float,
              sharing: bool, upgrade: bool) -> None:
    """One scheduling pass: Algorithm 1 over the queue in arrival order, then job upgrade."""
    cluster.unreserve()
    for job in list(queue):
        as_g = job.guaranteed or not sharing
        gpus = schedule_job(cluster, job, guaranteed=as_g)
        if gpus:
            cluster.place(job, gpus, guaranteed=as_g)
            running[job.name] = _Running(job, as_g, now, gpus, float(job.iterations))
            queue.remove(job)
    if upgrade:
        waiting = any(j.guaranteed or not sharing for j in queue)
        for name in sorted(running, key=lambda n: running[n].start_s):
            r = running[name]
            if not r.guaranteed and try_upgrade(cluster, r.job, waiting):
                r.guaranteed, r.upgraded_s = True, now


def run(jobs: Sequence[Job], nodes: int, gpus_per_node: int,
        memory_gb: float = GPU_MEMORY_GB, *, sharing: bool = True, upgrade: bool = True,
        interference: float = 0.0, spill_penalty: float = 1.0) -> RunResult:
    """Replay ``jobs`` (distinct names) on ``nodes`` x ``gpus_per_node`` GPUs of ``memory_gb``.
    ``sharing``: AntMan (True) or the dedicated-GPU baseline (False); ``upgrade``: job upgrade
    on; ``interference`` and ``spill_penalty``: see
    :func:`~tidal.sim.antman_cluster.coordinate`. Deterministic: the same jobs give the same
    result. Raises ``ValueError`` for a job the cluster can never run or duplicate names."""
    cluster = Cluster(nodes, gpus_per_node, memory_gb)
    if len({j.name for j in jobs}) != len(jobs):
        raise ValueError("run: job names must be distinct")
    for j in jobs:
        cluster.check(j)
    order = {j.name: i for i, j in enumerate(jobs)}
    arrivals = sorted(jobs, key=lambda j: (j.arrival_s, order[j.name]))
    queue: list[Job] = []
    running: dict[str, _Running] = {}
    done: dict[str, JobRecord] = {}
    now, busy_s, in_use_s, nxt = 0.0, 0.0, 0.0, 0
    while nxt < len(arrivals) or queue or running:
        while nxt < len(arrivals) and arrivals[nxt].arrival_s <= now:
            queue.append(arrivals[nxt])
            nxt += 1
        _schedule(cluster, queue, running, now, sharing, upgrade)
        shares = coordinate(cluster, {n: r.job for n, r in running.items()},
                            interference, spill_penalty)
        speed = {n: shares[n].rate / r.job.iteration_s for n, r in running.items()}
        ends = [now + r.left / speed[n] for n, r in running.items() if speed[n] > 0]
        t = min(ends + ([arrivals[nxt].arrival_s] if nxt < len(arrivals) else []),
                default=math.inf)
        if math.isinf(t):
            raise RuntimeError(f"run: jobs {[j.name for j in queue]} can never start")
        busy_s += sum(busy(cluster, shares)) * (t - now)
        in_use_s += sum(1 for g in cluster.gpus if g.guaranteed or g.opportunistic) * (t - now)
        shared = {g.guaranteed for g in cluster.gpus if g.opportunistic}
        for n, r in running.items():
            r.left -= speed[n] * (t - now)
            r.spilled_gb = max(r.spilled_gb, shares[n].spilled_gb)
            r.shared |= n in shared
        now = t
        for n in [n for n, r in running.items() if r.left <= 1e-9 * r.job.iterations]:
            r = running.pop(n)
            cluster.remove(n)
            done[n] = JobRecord(n, r.job.guaranteed, r.job.arrival_s, r.start_s, now, r.gpus,
                                r.upgraded_s, r.spilled_gb, r.shared)
    return RunResult(tuple(done[j.name] for j in jobs), busy_s, len(cluster.gpus), now, in_use_s)


def synthetic_trace(jobs: int, nodes: int, gpus_per_node: int, seed: int = 0, *,
                    load: float = 1.3, opportunistic: float = 0.3,
                    memory_gb: float = GPU_MEMORY_GB) -> list[Job]:
    """A seeded trace of ``jobs`` jobs shaped like the slides' production observations:

    * GPUs per job: 1 (60 %), 2 (15 %), 4 (15 %), 8 (10 %), at most the cluster; ``node``
      topology when the job fits one node, else ``any``;
    * memory per GPU: 90 % of jobs 0.1-0.5 GB ("90 % of DL models occupy only 500 MB"), the
      rest 0.5 GB to ``memory_gb`` (log-uniform);
    * mini-batch time: 80 % 50-600 ms ("80 % of tasks consume a mini-batch within 600 ms"), the
      rest 0.6-3 s; compute share: 90 % 0.1-0.8, 10 % 0.8-1 ("10 % of GPUs above 80 %
      utilization");
    * run time on dedicated GPUs 5 min to 8 h (log-uniform); a fraction ``opportunistic`` of
      jobs opportunistic (no quota);
    * Poisson arrivals at the rate that offers ``load`` times the cluster's GPUs in requested
      GPU-time over the arrival period.
    """
    if jobs < 1 or not load > 0 or not 0 <= opportunistic <= 1:
        raise ValueError("synthetic_trace: need jobs >= 1, load > 0, 0 <= opportunistic <= 1")
    rng = random.Random(seed)
    total = nodes * gpus_per_node

    def logu(lo: float, hi: float) -> float:
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))

    drawn = []
    for i in range(jobs):
        gpus = min(total, rng.choices((1, 2, 4, 8), (60, 15, 15, 10))[0])
        memory = logu(0.1, 0.5) if rng.random() < 0.9 else logu(0.5, memory_gb)
        it_s = logu(0.05, 0.6) if rng.random() < 0.8 else logu(0.6, 3.0)
        share = rng.uniform(0.1, 0.8) if rng.random() < 0.9 else rng.uniform(0.8, 1.0)
        iterations = max(1, round(logu(300.0, 8 * 3600.0) / it_s))
        drawn.append(Job(f"j{i:04d}", gpus, share, memory, rng.random() >= opportunistic,
                         "node" if gpus <= gpus_per_node else "any", iterations, it_s))
    rate = load * total / (sum(j.gpus * j.duration_s for j in drawn) / jobs)
    t, out = 0.0, []
    for j in drawn:
        out.append(replace(j, arrival_s=t))
        t += rng.expovariate(rate)
    return out


TABLE2 = {"Job-A": {"Preempt": None, "FIFO": 43.0, "Pack": 43.1, "UMem": 43.4, "AntMan": 43.9},
          "Job-B": {"Preempt": 91.1, "FIFO": 108.2, "Pack": None, "UMem": 541.6, "AntMan": 91.8}}
"""The slides' Table 2: JCT in minutes per configuration (None: the job failed)."""


def table2_jobs(gcn_share: float = 0.4, resnet_share: float = 0.6) -> list[Job]:
    """The slides' Table 1 on one GPU, in minutes as seconds of 60: Job-A (GCN, opportunistic,
    3.5 GB, arrives at 0, 43.0 min alone: its FIFO JCT) and Job-B (ResNet, guaranteed, 30 GB,
    arrives at 26 min, 91.1 min alone: its JCT when Job-A is preempted). The compute shares are
    not in the slides: ``gcn_share`` and ``resnet_share`` are assumptions."""
    return [Job("Job-A", 1, gcn_share, 3.5, False, iterations=430, iteration_s=6.0),
            Job("Job-B", 1, resnet_share, 30.0, True, iterations=911, iteration_s=6.0,
                arrival_s=26 * 60.0)]
