"""The ring-link fit inverts the textbook ring all-reduce, and measures a real gloo group."""
import pytest

from tidal.ir.comm_cost import ring_allreduce_us
from tidal.runtime.distributed import spawn
from tidal.runtime.comm.link_fit import fit_ring_link, measure_ring_link


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_fit_recovers_the_ring_parameters(world):
    sizes = (4096, 8 << 20)
    times = [ring_allreduce_us(b, world, bytes_per_us=1234.0, latency_us=17.0) for b in sizes]
    fit = fit_ring_link(world, sizes, times)
    assert fit.latency_us == pytest.approx(17.0, rel=1e-9)
    assert fit.bytes_per_us == pytest.approx(1234.0, rel=1e-9)
    assert fit.bandwidth_gbps == pytest.approx(1234.0 * 8 / 1e3)


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="world=1"):
        fit_ring_link(1, (1, 2), (1.0, 2.0))
    with pytest.raises(ValueError, match="two distinct"):
        fit_ring_link(2, (8, 8), (1.0, 2.0))


def test_measure_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        measure_ring_link()


def _measure(rank, size):
    return measure_ring_link(sizes=(4096, 1 << 20), repeats=3)


def test_measure_on_two_gloo_ranks():
    links = spawn(_measure, 2)
    assert all(link.bytes_per_us > 0 and link.latency_us >= 0 for link in links)
