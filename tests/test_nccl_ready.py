"""Multi-rank code ready for NCCL, shown without a GPU: with a process group that says "nccl"
(mocked), every tensor handed to a collective was asked for on the current CUDA device, never
built on the CPU (which NCCL refuses); with gloo it is the CPU. The DDP comm hooks train like DDP
on a group of one (gloo here; NCCL in the ``cuda`` test). (The torch-2.11 fallbacks of the
single-tensor all-gather and DDP's buffer-sync keyword: ``test_compat.py``.)"""

import pytest
import torch
import torch.distributed as dist

from tidal.runtime.comm.accordion import Accordion
from tidal.runtime.comm.compressors import ALL_GATHER, ALL_REDUCE, Comm, Message
from tidal.runtime.comm.ddp_check import ddp_hook_check
from tidal.runtime.distributed import all_reduce_tensors, collective_device
from tidal.runtime.comm.link_fit import time_allreduce_us

GPU = torch.device("cuda", 0)
COLLECTIVES = ("broadcast", "all_reduce", "barrier", "all_gather_into_tensor",
               "all_gather_single")


class _Work:
    def __init__(self, value):
        self._future = torch.futures.Future()
        self._future.set_result(value)

    def get_future(self):
        return self._future

    def wait(self):
        return True


class FakeNccl:
    """A default group whose backend is "nccl" (rank 0 of 2) on this CPU-only machine. A tensor
    asked for on CUDA (``device=`` of a factory, ``Tensor.to``) is made on the CPU and its
    asked device remembered; each collective records ``(name, asked devices of its tensors,
    dtypes)`` and computes as 2 identical ranks would (sums doubled, gathers repeated)."""

    def __init__(self, monkeypatch):
        self.asked: dict[int, torch.device] = {}   # by storage address
        self.kept: list[torch.Tensor] = []     # no storage freed and reused while it runs
        self.calls: list[tuple[str, list, list]] = []
        self.synced: list = []
        mp = monkeypatch
        mp.setattr(dist, "is_initialized", lambda: True)
        mp.setattr(dist, "get_backend", lambda group=None: "nccl")
        mp.setattr(dist, "get_world_size", lambda group=None: 2)
        mp.setattr(dist, "get_rank", lambda group=None: 0)
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        mp.setattr(torch.cuda, "synchronize", lambda device=None: self.synced.append(device))
        for name in ("tensor", "zeros", "empty", "ones", "full"):
            mp.setattr(torch, name, self._factory(getattr(torch, name)))
        mp.setattr(torch.Tensor, "to", self._to(torch.Tensor.to))
        for name in COLLECTIVES:
            mp.setattr(dist, name, self._collective(name), raising=False)

    def _remember(self, t, device):
        if device is not None and torch.device(device).type == "cuda":
            self.asked[t.untyped_storage().data_ptr()] = torch.device(device)
            self.kept.append(t)
        return t

    def _factory(self, make):
        def factory(*args, device=None, **kw):
            on_cuda = device is not None and torch.device(device).type == "cuda"
            t = make(*args, device=None if on_cuda else device, **kw)
            return self._remember(t, device)
        return factory

    def _to(self, to):
        def fake_to(t, *args, **kw):
            device = kw.get("device")
            rest = []
            for a in args:
                if isinstance(a, (torch.device, str)):
                    device = a
                else:
                    rest.append(a)
            if device is None or torch.device(device).type != "cuda":
                return to(t, *args, **kw)
            kw.pop("device", None)
            out = to(t, *rest, **kw)
            return self._remember(out.clone() if out is t else out, device)
        return fake_to

    def device_of(self, t):
        """The device ``t``'s storage was asked for (a view's: its base's)."""
        return self.asked.get(t.untyped_storage().data_ptr(), t.device)

    def _collective(self, name):
        def collective(*args, group=None, async_op=False, **kw):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            self.calls.append((name, [self.device_of(t) for t in tensors],
                               [t.dtype for t in tensors]))
            if name == "all_reduce":
                tensors[0].mul_(2)
            elif name.startswith("all_gather"):
                tensors[0].copy_(tensors[1].repeat(2))
            return _Work(tensors[:1]) if async_op else None
        return collective

    def devices(self, name):
        return [d for n, ds, _ in self.calls if n == name for d in ds]


@pytest.fixture
def nccl(monkeypatch):
    return FakeNccl(monkeypatch)


def test_collective_device_follows_the_backend(monkeypatch):
    assert collective_device() == torch.device("cpu")          # no group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for backend, device in (("gloo", "cpu"), ("nccl", "cuda:1"),
                            ("cpu:gloo,cuda:nccl", "cuda:1")):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert collective_device() == torch.device(device), backend


def test_accordion_broadcasts_its_flags_on_the_gpu(nccl):
    acc = Accordion(4, 1)
    assert acc.decide_from_norms({"a": 1.0, "b": 2.0}) == {"a": 4, "b": 4}
    assert nccl.devices("broadcast") == [GPU]


def test_link_fit_times_all_reduces_of_a_gpu_tensor_until_the_gpu_is_done(nccl):
    time_allreduce_us(4096, repeats=2, warmup=1)
    assert nccl.devices("all_reduce") == [GPU] * 3
    assert len(nccl.synced) >= 2 * 2 and set(nccl.synced) == {GPU}


def test_all_reduce_tensors_reduces_on_the_gpu_and_copies_back(nccl):
    a, b = torch.ones(2), torch.arange(3.0)
    all_reduce_tensors([a, b])
    assert nccl.devices("all_reduce") == [GPU]
    assert a.tolist() == [2.0, 2.0] and b.tolist() == [0.0, 2.0, 4.0]


def test_comm_sends_on_the_gpu_and_gathers_bytes(nccl):
    levels = torch.tensor([-200, 5, 300], dtype=torch.int16)   # QSGD past 127 levels: int16
    messages = [Message((torch.ones(3),), ALL_REDUCE),
                Message((torch.full((2,), 0.5), levels), ALL_GATHER)]
    (summed,), (values, gathered) = Comm().run(messages)
    assert [n for n, _, _ in nccl.calls] == ["all_reduce", "all_gather_single",
                                             "all_gather_single"]
    assert all(d == GPU for _, ds, _ in nccl.calls for d in ds), nccl.calls
    # NCCL has no int16: an all-gather moves the payload as bytes
    assert [dt for n, _, dts in nccl.calls if n.startswith("all_gather") for dt in dts] \
        == [torch.uint8] * 4
    assert summed.tolist() == [2.0] * 3
    assert values.tolist() == [[0.5, 0.5]] * 2
    assert gathered.dtype == torch.int16 and gathered.tolist() == [levels.tolist()] * 2


def test_ddp_hooks_train_like_ddp_on_a_gloo_group_of_one():
    result = ddp_hook_check("cpu", steps=3)
    assert result["backend"] == "gloo" and result["ok"], result
    for name in ("allreduce", "topk", "randomk"):
        hook = result["hooks"][name]
        assert hook["hook_calls"] == 3 and hook["max_param_diff"] == 0.0, (name, hook)
    assert not dist.is_initialized()       # the group of one is gone


def test_ddp_hook_check_refuses_a_group_already_there(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="already initialised"):
        ddp_hook_check("cpu")
    with pytest.raises(ValueError, match="unknown hook"):
        ddp_hook_check("cpu", hooks=("nope",))


@pytest.mark.cuda
def test_ddp_hooks_train_like_ddp_on_an_nccl_group_of_one():
    result = ddp_hook_check("cuda", steps=4)
    assert result["backend"] == "nccl" and result["device"] == "cuda:0"
    assert result["ok"], result
