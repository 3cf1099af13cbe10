"""AntMan's cluster scheduler (issue item 5): Algorithm 1's placement on scripted cluster states,
the local coordinator's shares and memory spill, job upgrade, and the simulated trace run."""
import math

import pytest

from tidal.sim.antman_cluster import (Cluster, Job, busy, coordinate, schedule_job,
                                      try_upgrade)
from tidal.sim.antman_trace import (TABLE2, percentile, run, synthetic_trace,
                                    table2_jobs)


def g(name, gpus=1, share=0.5, memory_gb=1.0, **kw):
    return Job(name, gpus, share, memory_gb, True, **kw)


def o(name, gpus=1, share=0.5, memory_gb=1.0, **kw):
    return Job(name, gpus, share, memory_gb, False, **kw)


def cluster_with(*placed, nodes=2, gpus_per_node=4, memory_gb=32.0):
    """A cluster with each (job, gpus) of ``placed`` on it, as the job's kind."""
    c = Cluster(nodes, gpus_per_node, memory_gb)
    for job, gpus in placed:
        c.place(job, gpus)
    return c


# --- Algorithm 1, guaranteed jobs ---------------------------------------------------------------

def test_guaranteed_job_that_fits_its_topology_gets_those_gpus():
    c = cluster_with((g("a"), (0,)))  # node 0: GPUs 1-3 free; node 1: 4-7 free
    assert schedule_job(c, g("three", 3)) == (1, 2, 3)  # best fit: the node with fewest free
    assert schedule_job(c, g("four", 4)) == (4, 5, 6, 7)
    assert schedule_job(Cluster(2, 4), g("two", 2)) == (0, 1)  # tie: lowest node and GPU
    assert not any(x.reserved_for for x in c.gpus)


def test_guaranteed_topology_any_spans_the_fewest_nodes():
    c = cluster_with((g("a", 2), (0, 1)), (g("b"), (4,)))  # free: node 0 {2, 3}, node 1 {5, 6, 7}
    assert schedule_job(c, g("five", 5, topo="any")) == (2, 3, 5, 6, 7)
    assert schedule_job(c, g("three", 3, topo="any")) == (5, 6, 7)  # one node holds it


def test_guaranteed_job_prefers_gpus_without_opportunistic_load_within_the_node():
    c = cluster_with((o("x", share=0.3), (0,)), (o("y", share=0.1), (1,)))
    c.place(g("full", 4), (4, 5, 6, 7))
    assert schedule_job(c, g("two", 2)) == (2, 3)
    assert schedule_job(c, g("three", 3)) == (1, 2, 3)


def test_guaranteed_job_that_does_not_fit_reserves_and_is_not_placed():
    c = cluster_with((g("a", 2), (0, 1)), (g("b", 3), (4, 5, 6)))
    big = g("big", 4)
    assert schedule_job(c, big) == ()
    assert [i for i, x in enumerate(c.gpus) if x.reserved_for == "big"] == [2, 3]  # most free
    assert c.gpus_of("big") == ()  # not placed
    # another guaranteed job cannot take the reserved GPUs; it reserves what is left
    assert schedule_job(c, g("two", 2)) == ()
    assert [i for i, x in enumerate(c.gpus) if x.reserved_for == "two"] == [7]
    assert schedule_job(c, g("one")) == ()  # every free GPU is reserved
    # an opportunistic job may still use a reserved GPU, the least loaded, lowest index first
    assert schedule_job(c, o("opp")) == (2,)
    # the reserving job sees its own reservation as free: once GPU 0 and 1 free up, it fits
    c.remove("a")
    assert schedule_job(c, big) == (0, 1, 2, 3)


# --- Algorithm 1, opportunistic jobs --------------------------------------------------------------

def test_opportunistic_job_goes_to_the_least_loaded_gpus_ties_to_lowest_index():
    c = cluster_with((g("a", share=0.9), (0,)), (g("b", share=0.3), (1,)),
                     (g("c", share=0.3), (2,)), (g("d", share=0.5), (3,)),
                     nodes=1, gpus_per_node=4)
    assert schedule_job(c, o("x", 2)) == (1, 2)
    assert schedule_job(c, o("x1")) == (1,)  # GPUs 1 and 2 tie at 0.3: the lower index
    c.place(o("y", share=0.3), (1,))  # GPU 1 now carries 0.6
    assert schedule_job(c, o("x2", 2)) == (2, 3)  # loads 0.9, 0.6, 0.3, 0.5
    assert not any(x.reserved_for for x in c.gpus)  # an opportunistic job never reserves


def test_opportunistic_placement_is_bounded_by_memory_and_compute_m():
    c = cluster_with((g("a", share=0.2, memory_gb=30.0), (0,)), (g("b", share=1.0), (1,)),
                     (g("c", share=0.6, memory_gb=20.0), (2,)), nodes=1, gpus_per_node=4)
    # GPU 0: least loaded but 2 GB free; GPU 1: load 1; GPU 2: 12 GB free; GPU 3: idle
    assert schedule_job(c, o("x", memory_gb=4.0)) == (3,)
    assert schedule_job(c, o("x", 2, memory_gb=4.0)) == (2, 3)
    assert schedule_job(c, o("x", 2, memory_gb=16.0)) == ()  # only GPU 3 meets M: waits
    assert schedule_job(c, o("x", 3, memory_gb=1.0)) == (0, 2, 3)


# --- local coordinator ------------------------------------------------------------------------

def test_opportunistic_jobs_get_only_the_idle_share_max_min_fair():
    jobs = {j.name: j for j in (g("a", share=0.6), o("x", share=0.3), o("y", share=0.1))}
    c = cluster_with((jobs["a"], (0,)), (jobs["x"], (0,)), (jobs["y"], (0,)))
    s = coordinate(c, jobs)
    assert s["a"].rate == 1.0 and s["a"].limit == "dedicated"
    # idle 0.4 for demands 0.3 + 0.1: both at the same fraction of dedicated speed
    assert s["x"].rate == pytest.approx(1.0) and s["y"].rate == pytest.approx(1.0)
    jobs["x"] = o("x", share=0.5)
    c.remove("x")
    c.place(jobs["x"], (0,))
    s = coordinate(c, jobs)
    assert s["x"].rate == pytest.approx(0.4 / 0.6) and s["y"].rate == pytest.approx(0.4 / 0.6)
    assert s["x"].limit == s["y"].limit == "idle share"
    assert busy(c, s)[0] == pytest.approx(1.0)


def test_multi_gpu_opportunistic_job_is_gated_by_its_busiest_gpu_and_the_rest_is_refilled():
    jobs = {j.name: j for j in (g("a", share=0.8), o("x", 2, share=0.5), o("y", share=1.0))}
    c = cluster_with((jobs["a"], (0,)), (jobs["x"], (0, 1)), (jobs["y"], (1,)))
    s = coordinate(c, jobs)
    assert s["x"].rate == pytest.approx(0.4)  # GPU 0 leaves 0.2 for a share of 0.5
    assert s["y"].rate == pytest.approx(0.8)  # GPU 1: 1 - 0.5 x 0.4
    assert busy(c, s)[:2] == pytest.approx([1.0, 1.0])


def test_memory_beyond_what_the_guaranteed_job_leaves_spills_to_host_at_a_stated_slowdown():
    jobs = {j.name: j for j in (g("res", share=0.5, memory_gb=30.0),
                                o("gcn", share=0.3, memory_gb=3.5))}
    c = cluster_with((jobs["gcn"], (0,)), (jobs["res"], (0,)))
    s = coordinate(c, jobs, spill_penalty=2.0)["gcn"]
    assert s.spilled_gb == pytest.approx(1.5) and s.limit == "host memory"
    assert s.rate == pytest.approx(1 / (1 + 2.0 * 1.5 / 3.5))
    assert coordinate(c, jobs, spill_penalty=0.0)["gcn"].rate == pytest.approx(1.0)
    # two opportunistic jobs over the limit keep the same fraction of their memory
    jobs["b"] = o("b", share=0.1, memory_gb=0.5)
    c.place(jobs["b"], (0,))
    s = coordinate(c, jobs)
    assert s["gcn"].spilled_gb == pytest.approx(3.5 * 2 / 4) and s["b"].spilled_gb == \
        pytest.approx(0.5 * 2 / 4)


def test_guaranteed_job_is_slowed_only_by_the_stated_interference():
    jobs = {j.name: j for j in (g("a"), g("b"), o("x", share=0.2))}
    c = cluster_with((jobs["a"], (0,)), (jobs["b"], (1,)), (jobs["x"], (0,)))
    s = coordinate(c, jobs, interference=0.02)
    assert s["a"].rate == pytest.approx(1 / 1.02) and s["a"].limit == "interference"
    assert s["b"].rate == 1.0 and coordinate(c, jobs)["a"].rate == 1.0


# --- job upgrade ------------------------------------------------------------------------------

def test_job_upgrade_when_its_gpus_free_up():
    x = o("x", 2)
    c = cluster_with((g("a"), (0,)), (x, (0, 1)))
    assert not try_upgrade(c, x, guaranteed_waiting=False)  # GPU 0 still has a guaranteed job
    c.remove("a")
    assert not try_upgrade(c, x, guaranteed_waiting=True)  # a guaranteed job waits
    c.reserve("other", (1,))
    assert not try_upgrade(c, x, guaranteed_waiting=False)  # GPU 1 is reserved for another
    c.unreserve()
    assert try_upgrade(c, x, guaranteed_waiting=False)
    assert [c.gpus[i].guaranteed for i in (0, 1)] == ["x", "x"] and not c.gpus[0].opportunistic
    assert schedule_job(c, g("b", 4)) == (4, 5, 6, 7)  # upgraded GPUs are no longer free


def test_job_upgrade_needs_the_topology():
    x = o("x", 2)  # topology "node", placed across nodes
    c = cluster_with((x, (3, 4)))
    assert not try_upgrade(c, x, guaranteed_waiting=False)
    y = o("y", 2, topo="any")
    c.place(y, (2, 5))
    assert try_upgrade(c, y, guaranteed_waiting=False)


def test_run_upgrades_an_opportunistic_job_when_the_guaranteed_job_leaves():
    jobs = [g("a", share=0.9, iterations=10, iteration_s=10.0),
            o("x", share=0.5, iterations=100, iteration_s=1.0, arrival_s=1.0)]
    r = {x.name: x for x in run(jobs, 1, 1).records}
    assert r["x"].start_s == 1.0 and r["x"].upgraded_s == 100.0  # a's finish
    # 99 s at a fifth of its speed (idle 0.1 of demand 0.5), then dedicated
    assert r["x"].finish_s == pytest.approx(100.0 + 100 - 99 * 0.2)
    assert r["a"].shared and r["a"].finish_s == 100.0


# --- the trace run --------------------------------------------------------------------------------

def test_trace_run_is_deterministic():
    jobs = synthetic_trace(40, 2, 4, seed=3)
    assert jobs == synthetic_trace(40, 2, 4, seed=3) and jobs != synthetic_trace(40, 2, 4, seed=4)
    assert run(jobs, 2, 4) == run(jobs, 2, 4)
    small = [j.memory_gb < 0.5 for j in synthetic_trace(400, 2, 4, seed=0)]
    assert 0.85 < sum(small) / len(small) < 0.95  # "90 % of DL models occupy only 500 MB"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_opportunistic_jobs_raise_utilization_within_a_bound_on_guaranteed_jct(seed):
    jobs = synthetic_trace(80, 2, 4, seed)
    dedicated = run(jobs, 2, 4, sharing=False)
    antman = run(jobs, 2, 4, interference=0.01)
    assert antman.utilization > 1.1 * dedicated.utilization
    assert antman.in_use_utilization > dedicated.in_use_utilization
    # stated bound: guaranteed jobs' mean and p90 JCT at most 5 % above the dedicated baseline
    assert antman.stats()["jct_mean"] <= 1.05 * dedicated.stats()["jct_mean"]
    assert antman.stats()["jct_p90"] <= 1.05 * dedicated.stats()["jct_p90"]
    by_name = {j.name: j for j in jobs}
    for r in antman.select(True):  # while running, never slower than the interference allows
        d = by_name[r.name].duration_s
        assert d * (1 - 1e-9) <= r.finish_s - r.start_s <= d * 1.01 * (1 + 1e-9)


def test_without_upgrade_or_interference_guaranteed_jobs_run_as_if_alone():
    jobs = synthetic_trace(80, 2, 4, seed=2)
    shared = run(jobs, 2, 4, upgrade=False)
    alone = run([j for j in jobs if j.guaranteed], 2, 4)
    assert any(r.shared for r in shared.select(True))
    for a, b in zip(shared.select(True), alone.records):
        assert a.name == b.name and a.start_s == pytest.approx(b.start_s, rel=1e-9) \
            and a.finish_s == pytest.approx(b.finish_s, rel=1e-9)


def test_slides_table2_two_jobs():
    minutes = lambda result: {r.name: r.jct_s / 60 for r in result.records}  # noqa: E731
    fifo = minutes(run(table2_jobs(), 1, 1, sharing=False))
    assert fifo["Job-A"] == pytest.approx(TABLE2["Job-A"]["FIFO"])
    assert fifo["Job-B"] == pytest.approx(43.0 - 26 + 91.1)  # the slides' 108.2
    antman = run(table2_jobs(), 1, 1, upgrade=False)  # Job-A has no quota: never upgraded
    assert minutes(antman)["Job-B"] == pytest.approx(TABLE2["Job-B"]["Preempt"])
    assert antman.records[0].spilled_gb == pytest.approx(1.5)  # 3.5 GB beside 30 GB on 32 GB
    assert minutes(antman)["Job-A"] > TABLE2["Job-A"]["FIFO"]


def test_invalid_inputs_are_named():
    with pytest.raises(ValueError, match="do not fit"):
        run([g("a", 5)], 2, 4)
    with pytest.raises(ValueError, match="exceeds"):
        run([g("a", memory_gb=40.0)], 1, 1)
    with pytest.raises(ValueError, match="distinct"):
        run([g("a"), g("a")], 1, 1)
    with pytest.raises(ValueError, match="share"):
        g("a", share=0.0)
    assert percentile([], 90) == 0.0 and math.isclose(percentile([1.0, 2.0], 90), 2.0)
