"""Layer-group loading on a device: cold starts load where they are told, the host copy is
read, pinned and verified once, the timeline is on the backend's clock, captures fork every
generator, and (on a GPU) loads and compute run on the backend's streams and overlap."""
import copy
import dataclasses
import json
import struct

import pytest
import torch

import tidal
from tidal.passes.layer_groups import LayerGroups
from tidal.runtime.weights import store as weight_store
from tidal.runtime.backend import LogicalBackend
from tidal.runtime.programs import layer_group_loads, layer_groups, step_capture
from tidal.runtime.programs.layer_groups import LOADING_STEP, LayerGroupsProgram, from_plan
from tidal.runtime.weights.loader import write_groups
from tidal.runtime.weights.store import WeightStore, WeightStoreError


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 3)).eval()


def _grouped(tmp_path):
    """(model, inputs, compiled with one group per layer, its store path)."""
    model, x = _mlp(), torch.randn(2, 4)
    c = tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer")])
    path = tmp_path / "w.safetensors"
    write_groups(c.graph_module, path)
    return model, x, c, path


def test_cold_start_loads_onto_the_device_it_is_given(tmp_path):
    # the meta device stands for a GPU: the CPU parameters cannot be pointed at it unless the
    # device reaches the loader (and the forward then runs there, on inputs moved there)
    _, x, c, path = _grouped(tmp_path)
    c.graph_module.to("meta")
    out = c.cold_start(path, device="meta")
    assert out.device.type == "meta" and out.shape == (2, 3)
    assert {p.device.type for p in c.graph_module.parameters()} == {"meta"}
    # by default, where the model's parameters are
    assert c.cold_start(path, torch.randn(5, 4)).device.type == "meta"
    plan = c.plan.get("layer_groups")
    program = from_plan(c.graph_module, dataclasses.replace(plan, weight_store=str(path)))
    assert program.device.type == "meta"


def test_host_copy_is_allocated_once_and_each_group_verified_once(tmp_path, monkeypatch):
    model, x, c, path = _grouped(tmp_path)
    allocated, verified = [], []
    verify = WeightStore.verify
    buffer = getattr(weight_store, "host_buffer", None)
    monkeypatch.setattr(weight_store, "host_buffer",
                        lambda n, pin: allocated.append((n, pin)) or buffer(n, pin),
                        raising=False)
    monkeypatch.setattr(WeightStore, "verify",
                        lambda self, k, b: verified.append(k) or verify(self, k, b))
    gm = c.graph_module.to("meta")
    program = LayerGroupsProgram(path, device="meta")
    groups = len(c.plan.get("layer_groups").groups)
    for _ in range(2):  # two loads of every group
        out, tl = program.run(gm, (x.to("meta"),))
        assert out.device.type == "meta" and len(tl.transfer) == groups
    assert sorted(verified) == list(range(groups))  # read from the file and checked once
    assert len(allocated) == 1 and not allocated[0][1]  # one buffer; pinned only for a GPU
    assert LayerGroupsProgram(path, device="cuda").host.pin  # (nothing touches CUDA yet)

    # bytes overwritten since: the file is read and checked again, the corrupt tensor named
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    lo, hi = json.loads(raw[8:8 + n])["2.weight"]["data_offsets"]
    with open(path, "r+b") as f:
        f.seek(8 + n + lo)
        f.write(b"\xff" * (hi - lo))
    with pytest.raises(WeightStoreError, match=r"'2\.weight' \(group 2\)"):
        program.run(gm, (x.to("meta"),))
    assert len(allocated) == 1


def test_timeline_is_on_the_backend_clock(tmp_path):
    model, x, c, path = _grouped(tmp_path)
    with torch.no_grad():
        expected = model(x)
        for p in model.parameters():
            p.zero_()
    # scripted device times: a load takes 1000 µs, a group 100 µs, on the logical clock
    backend = LogicalBackend(lambda label, _: 1000.0 if "/load" in label else 100.0)
    out, tl = layer_groups.run_pipelined(c.graph_module, path, (x,), backend=backend)
    assert torch.equal(out, expected)
    n = len(tl.transfer)
    assert tl.transfer == tuple((k * 1e-3, (k + 1) * 1e-3) for k in range(n))
    for k, (start, end) in enumerate(tl.execute):  # each group after its load: 100 µs
        assert start == pytest.approx((k + 1) * 1e-3) and end == pytest.approx(start + 1e-4)
    assert tl.first_output == pytest.approx(n * 1e-3 + 1e-4)
    t0 = min(t.start_us for t in tl.trace)
    spans = {t.name: ((t.start_us - t0) * 1e-6, (t.end_us - t0) * 1e-6) for t in tl.trace}
    assert tl.transfer[0] == spans["load group 0"] and tl.execute[-1] == spans[f"group {n - 1}"]


def _train_compiled(tmp_path, device="cpu"):
    """A model trained from its store (its weights zeroed) and an eager reference copy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 3)).to(device)
    x, y = torch.randn(6, 4, device=device), torch.randint(0, 3, (6,), device=device)
    path = tmp_path / "train.safetensors"
    write_groups(tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer")],
                               lower="none").graph_module, path)
    reference = copy.deepcopy(model)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    c = tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer",
                                                       weight_store=str(path))],
                      loss_fn=torch.nn.functional.cross_entropy, optimizer=sgd)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return c, reference, sgd(reference.parameters()), x, y


def _eager_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def test_training_captures_fork_the_generators_of_what_they_capture(tmp_path, monkeypatch):
    c, reference, opt, x, y = _train_compiled(tmp_path)
    forked = []
    real = step_capture.fork_rng_of  # the captures of every builder fork there

    def recording(*values):
        forked.append(values)
        return real(*values)

    monkeypatch.setattr(step_capture, "fork_rng_of", recording)
    assert c.step((x,), y).item() == pytest.approx(_eager_step(reference, opt, x, y), rel=1e-6)
    loading = c.executor.uncaptured()
    assert c.step((x,), y).item() == pytest.approx(_eager_step(reference, opt, x, y), rel=1e-6)
    ((flats,),) = forked  # one capture, after the load: the resident parameters themselves
    (flat,) = flats.values()  # one replica's flat inputs
    assert all(any(v is p for v in flat) for p in c.graph_module.parameters())
    assert loading == [("-", LOADING_STEP)]  # the first step loaded them, uncaptured
    assert c.executor.uncaptured() == [] and c.executor.fallback_reason == ""


# ---------------------------------------------------------------- on a GPU
@pytest.mark.cuda
def test_cold_start_on_cuda_equals_the_model(tmp_path):
    from examples.models import ZOO

    torch.manual_seed(0)
    model = ZOO["resnet50_small"]().eval()
    x = model.example_inputs(2)
    c = tidal.compile(model, x, passes=[LayerGroups()])
    path = tmp_path / "w.safetensors"
    write_groups(c.graph_module, path)
    on_gpu = copy.deepcopy(model).cuda()
    with torch.no_grad():
        expected = on_gpu(*(t.cuda() for t in x))
        for p in model.parameters():
            p.zero_()
    out = c.cold_start(path, device="cuda")
    assert out.is_cuda
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert all(p.is_cuda for p in c.graph_module.parameters())
    out = c.cold_start(path)  # the parameters are on the GPU now: the default
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
def test_loads_overlap_compute_on_the_backends_streams(tmp_path, monkeypatch):
    # wide layers (64 MiB each): each copy takes longer on the device than its launch on the
    # host, so the device clock shows the loads streaming while the groups compute
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)],
                                torch.nn.Linear(4096, 10)).eval().cuda()
    x = torch.randn(8, 4096, device="cuda")
    c = tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer")], lower="none")
    path = tmp_path / "w.safetensors"
    write_groups(c.graph_module, path)
    with torch.no_grad():
        expected = model(x)
    seen: dict = {}
    load, ready = layer_group_loads.GroupLoads.load, layer_group_loads.GroupLoads.ready

    def on(kind, fn):
        def wrapped(self, k):
            s = torch.cuda.current_stream()
            seen.setdefault(kind, set()).add((s.cuda_stream, s.priority))
            return fn(self, k)
        return wrapped

    monkeypatch.setattr(layer_group_loads.GroupLoads, "load", on("load", load))
    monkeypatch.setattr(layer_group_loads.GroupLoads, "ready", on("compute", ready))
    program = LayerGroupsProgram(path, device="cuda")
    for _ in range(2):  # the second from the pinned host copy: copies by DMA only
        seen.clear()
        out, tl = program.run(c.graph_module, (x,))
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert program.host._buffer.is_pinned()
    (load_stream, load_priority), = seen["load"]  # one stream for the loads of a run ...
    (compute_stream, compute_priority), = seen["compute"]  # ... another for the groups
    assert len({load_stream, compute_stream, torch.cuda.default_stream().cuda_stream}) == 3
    assert load_priority > compute_priority  # loads less urgent than the job's compute
    n = len(tl.transfer)
    assert n == 5
    for k in range(n - 1):  # device clock: group k+1 loads while group k computes
        assert tl.transfer[k + 1][0] < tl.execute[k][1], (k, tl.transfer, tl.execute)
    for k in range(n):
        assert tl.execute[k][0] >= tl.transfer[k][1] - 1e-6  # after its own load
    assert tl.overlaps(), tl


@pytest.mark.cuda
def test_training_from_a_store_on_cuda_equals_eager(tmp_path):
    c, reference, opt, x, y = _train_compiled(tmp_path, "cuda")
    for step in range(3):  # the load (eager), then captured CUDA graphs on the resident weights
        want = _eager_step(reference, opt, x, y)
        assert c.step((x,), y).item() == pytest.approx(want, rel=1e-4), step
    assert c.executor.fallback_reason == ""
    for (name, p), q in zip(c.graph_module.named_parameters(), reference.parameters()):
        assert p.is_cuda
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
