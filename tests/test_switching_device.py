"""Task switching on a GPU, the faults a CPU can show (issue 31): a bare "cuda" resolved to an
indexed device once; a spill on the region's device; optimizer state and outputs leaving the
device before they cross processes, and a message that cannot cross failing at once; batches
moved to the task's device; host copies page-locked by the worker that copies from them, with
cudaHostRegister's return code checked. ``cuda``-marked tests run the same paths on a GPU."""
from __future__ import annotations

import queue
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tidal.runtime.switching.task as task_module
from test_switching import _infer_job, _shipped
from tidal.runtime.switching import (ArenaStack, HostModel, StepResult, Switcher,
                                     SwitchingError, Task)
from tidal.runtime.switching.device import enter_device, resolve_device, to_device, to_host
from tidal.runtime.switching.messages import send, unsendable
from tidal.runtime.switching.switcher import _Worker
from tidal.runtime.switching.worker import _light


def _fake_cuda(monkeypatch, index: int) -> None:
    """CUDA "available" with ``index`` the current device (nothing else of CUDA is faked)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: index)


def test_bare_cuda_resolves_once_to_the_current_device(monkeypatch):
    """``Switcher(device="cuda")`` holds an indexed device (``torch.cuda.set_device`` refuses
    one without an index), the one current where the switcher is built."""
    _fake_cuda(monkeypatch, 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    assert Switcher([_infer_job()[0]], "cuda").device == torch.device("cuda", 1)


def test_bare_cuda_without_cuda_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SwitchingError, match="device 'cuda': CUDA is not available"):
        resolve_device("cuda")


def test_a_worker_enters_an_indexed_device(monkeypatch):
    """The worker's ``set_device`` gets an index (torch's own check runs: it raised
    ValueError on the bare device the worker used to pass)."""
    _fake_cuda(monkeypatch, 1)
    entered = []
    monkeypatch.setattr(torch._C, "_cuda_setDevice", entered.append, raising=False)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    assert enter_device("cuda") == torch.device("cuda", 1) and entered == [1]
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))


def test_a_spill_lands_on_the_regions_device():
    """Past its cap a job gets memory on the arena's device, outside the arena (it used to get
    a host tensor: a device mismatch on a GPU)."""
    s = ArenaStack(torch.empty(4096, dtype=torch.uint8, device="meta"), cap=1024)
    carved = s.take((64,), torch.float32)
    spilled = s.take((256,), torch.float32)
    assert carved.device.type == spilled.device.type == "meta"
    assert (s.used, s.spills, s.spilled_bytes) == (256, 1, 1024)


def test_optimizer_state_and_outputs_leave_the_device_before_crossing():
    """What a worker sends (the optimizer state from cleaning, an output) holds no tensor on a
    device: a CUDA tensor received over IPC cannot be sent again (controller -> next worker).
    Fake CUDA tensors stand in for real ones."""
    kept = torch.ones(1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        state = {"state": {0: {"momentum_buffer": torch.empty(3, device="cuda"), "step": kept}},
                 "param_groups": [{"lr": 0.1, "params": [0]}]}
        output = StepResult(0, (torch.empty(2, 3, device="cuda"),), None, 0.1)
        host_state, host_output = to_host(state), _light(output)
    assert "on cuda:0" in unsendable(("stopped", 0, "a", 1, state, 0.0))
    assert unsendable(("stopped", 0, "a", 1, host_state, 0.0)) is None
    assert host_state["state"][0]["momentum_buffer"].device.type == "cpu"
    assert host_state["state"][0]["step"] is kept
    assert host_state["param_groups"] == state["param_groups"]
    assert host_output.value[0].device.type == "cpu"


def test_a_message_that_cannot_cross_fails_at_once_naming_sender_and_kind():
    """``send`` refuses, in the sender, what the queue's feeder thread would fail to pickle
    (lost there: the receiver waited for its timeout)."""
    q = queue.Queue()
    with pytest.raises(SwitchingError, match=r"worker 3 \(job 'a'\): message 'stopped' cannot "
                                             r"cross processes: it holds a tensor of shape "
                                             r"\(2,\) on meta"):
        send(q, ("stopped", 3, "a", 1, {"m": torch.ones(2, device="meta")}, 0.0),
             "worker 3 (job 'a')")
    with pytest.raises(SwitchingError, match="message 'output' cannot cross processes: it does "
                                             "not pickle"):
        send(q, ("output", 3, "a", lambda: 0), "worker 3 (job 'a')")
    assert q.empty()
    send(q, ("done", 3, "a", 2, {"m": torch.ones(2)}), "worker 3 (job 'a')")
    assert q.get_nowait()[:4] == ("done", 3, "a", 2)


class _Runner:
    """A ProgramRunner stand-in that records how it was built."""

    built: list[dict] = []

    def __init__(self, **options):
        self.built.append(options)

    def close(self) -> None:
        pass


def test_task_runs_on_its_device_and_moves_the_batch_there(monkeypatch):
    """The task's program runner gets the task's device (its backend is the device's own) and
    warm-up moves the job's first batch to the task's device (it fed the batch wherever it
    lived)."""
    moved = []

    def spy(tree, device):
        moved.append((tree, device))
        return to_device(tree, device)
    monkeypatch.setattr(task_module, "ProgramRunner", _Runner)
    monkeypatch.setattr(task_module, "to_device", spy)
    monkeypatch.setattr(_Runner, "built", [])
    job, _, x = _infer_job()
    task = Task(_shipped(job))
    task.warm_up(HostModel.of(job.graph))
    assert _Runner.built == [{"device": task.device}]
    assert len(moved) == 1 and moved[0][1] == task.device and moved[0][0][0] is x


def test_activate_refuses_a_region_on_another_device():
    job, _, _ = _infer_job()
    task = Task(_shipped(job))
    region = torch.empty(4096, dtype=torch.uint8, device="meta")
    with pytest.raises(SwitchingError, match="job 'infer': its arena region is on meta, its "
                                             "task on cpu"):
        task.activate(HostModel.of(job.graph), ArenaStack(region))
    task.close()


class _Cudart:
    """A stand-in for ``torch.cuda.cudart()`` returning the given codes."""

    def __init__(self, register: int = 0, unregister: int = 0):
        self.codes, self.calls = (register, unregister), []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size))
        return self.codes[0]

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return self.codes[1]

    def cudaGetErrorString(self, code):
        return {2: "out of memory", 713: "pointer does not correspond to a registered memory "
                                         "region"}[int(code)]


def test_page_lock_registers_in_its_own_process_and_unregisters(monkeypatch):
    """The controller registers nothing (pinning is per process); a worker's page lock
    registers every group's buffer and unregisters them on close."""
    cudart = _Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    host = HostModel.of(_infer_job()[0].graph)
    assert cudart.calls == []
    lock = host.page_lock("job 'infer'")
    assert cudart.calls == [("register", b.data_ptr(), b.numel()) for b in host.buffers]
    assert not lock.failures and len(lock.locked) == host.num_groups
    lock.close()
    assert cudart.calls[host.num_groups:] == [("unregister", b.data_ptr()) for b in host.buffers]


def test_page_lock_reports_a_failed_register_by_name(monkeypatch):
    """cudaHostRegister's return code is checked: a failure names the host copy, the group and
    the CUDA error (it was ignored); that buffer stays pageable and is not unregistered."""
    cudart = _Cudart(register=2, unregister=713)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    host = HostModel.of(_infer_job()[0].graph)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lock = host.page_lock("job 'infer'")
    assert [str(w.message) for w in caught] == lock.failures and lock.locked == []
    assert len(lock.failures) == host.num_groups and lock.failures[0].startswith(
        "host copy of job 'infer', group 0: cudaHostRegister failed: CUDA error 2 (out of "
        "memory); its copies run unpinned")
    lock.close()
    assert all(call[0] == "register" for call in cudart.calls)


def test_page_lock_reports_a_failed_unregister(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart(unregister=713))
    lock = HostModel.of(_infer_job()[0].graph).page_lock("job 'infer'", warn=False)
    lock.close()
    assert lock.failures and "group 0: cudaHostUnregister failed: CUDA error 713" \
        in lock.failures[0]


def test_the_controller_warns_of_what_a_worker_could_not_page_lock():
    """A worker reports the host copies it could not page-lock with its "ready"; the
    controller warns, naming the worker."""
    sw = Switcher([_infer_job()[0]])
    sw.workers = [_Worker(0, proc=None, inbox=None, preempt=None)]
    note = "host copy of job 'infer', group 0: cudaHostRegister failed: CUDA error 2"
    with pytest.warns(RuntimeWarning, match=f"worker 0: {note}"):
        sw._handle(("ready", 0, 0.5, [note]))
    assert sw.workers[0].startup_s == 0.5


@pytest.mark.cuda
def test_page_lock_registers_a_host_copy_on_cuda():
    """cudaHostRegister accepts the shared-memory buffers of a host copy (success returned for
    each) and a non-blocking copy from them to the device is right; they unregister."""
    host = HostModel.of(_infer_job()[0].graph)
    lock = host.page_lock("job 'infer'")
    assert not lock.failures and len(lock.locked) == host.num_groups
    copies = [b.to("cuda", non_blocking=True) for b in host.buffers]
    torch.cuda.synchronize()
    assert all(torch.equal(c.cpu(), b) for c, b in zip(copies, host.buffers))
    lock.close()
    assert not lock.failures and lock.locked == []


@pytest.mark.cuda
def test_task_on_bare_cuda_transmits_on_its_device():
    """A task on a bare "cuda" resolves it, runs its program on the CUDA backend, and its
    weights arrive in the arena on that device, the output right."""
    job, model, x = _infer_job()
    host = HostModel.of(job.graph)
    task = Task(_shipped(job), "cuda")
    assert task.device.index is not None
    assert type(task.runner.backend).__name__ == "CudaBackend"
    lock = host.page_lock("job 'infer'")
    task.warm_up(host)
    stack = ArenaStack(torch.empty(1 << 20, dtype=torch.uint8, device=task.device))
    task.activate(host, stack)
    out = task.step(0, stack).value
    assert all(stack.on_arena(p) for p in task.gm.parameters())
    torch.testing.assert_close(out, model.to(task.device)(x.to(task.device)))
    again = task.step(1, stack).value
    assert torch.equal(again, out)
    task.close()
    torch.cuda.synchronize()
    lock.close()
    assert not lock.failures
