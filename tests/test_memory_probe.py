"""MemoryProbe: the live peak of the activations autograd saves, and state_bytes."""
import threading

import pytest
import torch

from tidal.runtime.weights.memory_probe import MemoryProbe, heap_bytes, state_bytes


def _mlp(width=64, depth=4):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 3))


def _micro_batches(m=4, rows=16, width=64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, width, generator=g), torch.randint(0, 3, (rows,), generator=g))
            for _ in range(m)]


def _run(model, batches, order):
    """Run forwards ('F') and backwards ('B') of the micro-batches in ``order``, each
    backward on the oldest forward not yet run backward (as a pipeline stage does)."""
    pending, f = [], 0
    for kind in order:
        if kind == "F":
            x, y = batches[f]
            pending.append(torch.nn.functional.cross_entropy(model(x), y) / len(batches))
            f += 1
        else:
            pending.pop(0).backward()


def test_one_f_one_b_pattern_peaks_lower_than_all_forwards_first():
    model, batches = _mlp(), _micro_batches()
    with MemoryProbe(model) as gpipe:
        _run(model, batches, "FFFFBBBB")
    model.zero_grad()
    with MemoryProbe(model) as one_f_one_b:   # warm up with 2 forwards, then 1F1B
        _run(model, batches, "FFBFBFBB")
    assert gpipe.live_bytes == one_f_one_b.live_bytes == 0
    assert gpipe.saved_bytes == one_f_one_b.saved_bytes > 0   # the same tensors were saved
    one = gpipe.saved_bytes / 4
    assert gpipe.peak_bytes == pytest.approx(4 * one, rel=0.05)
    assert one_f_one_b.peak_bytes == pytest.approx(2 * one, rel=0.05)
    assert one_f_one_b.peak_bytes < gpipe.peak_bytes


def test_a_region_without_autograd_shows_zero():
    model, batches = _mlp(), _micro_batches(m=1)
    with MemoryProbe(model) as probe, torch.no_grad():
        model(batches[0][0])
    assert (probe.peak_bytes, probe.saved_bytes, probe.live_bytes) == (0, 0, 0)
    with MemoryProbe(model) as probe:   # nothing requires grad: nothing saved
        torch.relu(torch.randn(8, 8)) @ torch.randn(8, 8)
    assert probe.peak_bytes == 0 and probe.saves == 0


def test_parameters_buffers_and_views_of_parameters_are_not_activations():
    lin = torch.nn.Linear(32, 32, bias=False)
    lin.register_buffer("scale", torch.ones(32))
    x = torch.randn(4, 32)
    with MemoryProbe(lin) as probe:
        (lin(x) * lin.scale).sum().backward()
    assert probe.saves >= 2            # x (for the weight's gradient), weight.t(), the buffer
    assert probe.peak_bytes == x.numel() * 4
    with MemoryProbe() as unnamed:     # no module given: the parameter is still excluded
        lin(x).sum().backward()
    assert unnamed.peak_bytes == x.numel() * 4


def test_each_storage_counts_once_and_leaves_when_autograd_frees_it():
    w = torch.nn.Parameter(torch.randn(16, 16))
    a = torch.randn(16, 16)
    with MemoryProbe() as probe:
        h = torch.relu(a @ w)          # relu saves h
        out = (h @ w).sum() + (h.view(-1) * 2).sum() + (h.t() @ w).sum()   # h again, as views
        assert probe.live_bytes == a.nbytes + h.nbytes
        out.backward()
    assert probe.live_bytes == 0       # a is still alive here, but autograd let go of it
    assert probe.peak_bytes == probe.saved_bytes == a.nbytes + h.nbytes


def test_the_probe_can_be_reused_and_reports_a_summary():
    model, batches = _mlp(), _micro_batches(m=1)
    probe = MemoryProbe(model)
    for _ in range(2):
        with probe:
            _run(model, batches, "FB")
        assert probe.peak_bytes > 0 and probe.live_bytes == 0
    assert "peak" in probe.summary()


@pytest.mark.skipif(heap_bytes() is None, reason="glibc mallinfo2 not available")
def test_host_sampling_sees_other_threads_allocations():
    hold = threading.Event()
    release = threading.Event()

    def work():
        big = torch.ones(1 << 22)      # 16 MiB on another thread, no autograd
        hold.set()
        release.wait(5)
        del big

    with MemoryProbe(host=True, interval_s=1e-4) as probe:
        t = threading.Thread(target=work)
        t.start()
        hold.wait(5)
        probe._sample()                # the sampler thread reads too; make it deterministic
        release.set()
        t.join()
    assert probe.peak_bytes == 0
    assert probe.heap_peak_bytes >= 16 * 2 ** 20


def test_state_bytes_counts_parameters_grads_and_optimizer_state_once():
    emb = torch.nn.Embedding(10, 8)
    head = torch.nn.Linear(8, 10, bias=False)
    head.weight = emb.weight           # tied
    model = torch.nn.Sequential(emb, head)
    assert state_bytes(model) == 10 * 8 * 4
    model(torch.tensor([1, 2])).sum().backward()
    opt = torch.optim.Adam(model.parameters())
    opt.step()
    # weight + grad + exp_avg + exp_avg_sq, plus Adam's scalar step counter
    assert state_bytes(model, opt) == 4 * 10 * 8 * 4 + opt.state[emb.weight]["step"].nbytes


def test_a_graph_left_from_an_earlier_region_does_not_disturb_the_next():
    model, batches = _mlp(), _micro_batches(m=1)
    x, y = batches[0]
    probe = MemoryProbe(model)
    with probe:
        old = torch.nn.functional.cross_entropy(model(x), y)   # its backward runs later
    with probe:
        loss = torch.nn.functional.cross_entropy(model(x), y)  # saves x's storage again
        live = probe.live_bytes
        old.backward()                 # frees what the first region counted, x's save too
        assert probe.live_bytes == live
        loss.backward()
    assert probe.live_bytes == 0 and probe.peak_bytes == live
