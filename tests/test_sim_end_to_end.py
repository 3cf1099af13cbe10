"""The end-to-end benchmark's links, from synthetic rounds (no ranks spawned, no timing).

``benchmarks/sim_end_to_end.py`` times, per round, a loop of the local step and an all-reduce
(``CHAIN`` + 1 of them from a barrier) and fits two links to it: ``loop`` to every all-reduce
but the last (each followed by the next step, as a loop's end-of-step sync is) and ``after``
to the last (followed by nothing). The test builds rounds whose loop all-reduces take longer
than the last one and checks that each link is fitted to its own, from the last rank's issue
to the last end."""
import pytest

from benchmarks.sim_end_to_end import CHAIN, _over_rounds
from tidal.runtime.comm.link_fit import DEFAULT_SIZES, fit_ring_link

LOOP_US = {DEFAULT_SIZES[0]: 3000.0, DEFAULT_SIZES[1]: 9000.0}
LAST_US = {DEFAULT_SIZES[0]: 1000.0, DEFAULT_SIZES[1]: 6000.0}
SKEW_US = 400.0  # rank 0 issues this much before rank 1 (its wait is not the link's)


def _round(rank: int) -> dict:
    """One round of ``rank``: every key ``_over_rounds`` reads, times in seconds."""
    row = {16: (20e3, 1e3), "ddp local": (21e3, 1e3), "dp": 25e3, "burst": 40e3,
           "burst parts": {"segment": 30e3}}
    skew = 0.0 if rank == 0 else SKEW_US * 1e-6
    for n in DEFAULT_SIZES:
        # step i a second apart (no two overlap); every rank ends at rank 1's issue + took
        row[f"after {n}"] = [
            (i + skew, i + SKEW_US * 1e-6 + (LAST_US if i == CHAIN else LOOP_US)[n] * 1e-6)
            for i in range(CHAIN + 1)]
        row[f"beside {n}"] = [(skew, (SKEW_US + LOOP_US[n]) * 1e-6)]
    return row


def test_loop_and_last_all_reduces_fit_their_own_links():
    ranks = [[_round(r), _round(r)] for r in range(2)]
    steps, dp, burst, links, parts = _over_rounds(ranks, "median")
    want_loop = fit_ring_link(2, DEFAULT_SIZES, [LOOP_US[n] for n in DEFAULT_SIZES])
    want_last = fit_ring_link(2, DEFAULT_SIZES, [LAST_US[n] for n in DEFAULT_SIZES])
    # from the last rank's issue (rank 1's) to the last end: rank 0's early issue not counted
    assert links["loop"].latency_us == pytest.approx(want_loop.latency_us, rel=1e-3)
    assert links["loop"].bytes_per_us == pytest.approx(want_loop.bytes_per_us, rel=1e-3)
    assert links["after"].latency_us == pytest.approx(want_last.latency_us, rel=1e-3)
    assert links["after"].bytes_per_us == pytest.approx(want_last.bytes_per_us, rel=1e-3)
    assert links["loop"].latency_us > links["after"].latency_us
    # beside: from each rank's own issue (the first), so the skew is the link's
    want_beside = fit_ring_link(2, DEFAULT_SIZES, [LOOP_US[n] + SKEW_US for n in DEFAULT_SIZES])
    assert links["beside"].latency_us == pytest.approx(want_beside.latency_us, rel=1e-3)
    assert steps[16].fwd_bwd_us == 20e3 and dp == 25e3 and burst == 40e3
    assert parts == {"segment": 30e3}
