"""``tidal.hooks``: asynchronous DDP hooks on 2 gloo ranks. A hook returns before its collective
completes; with many buckets (PowerSGD's two rounds issued from callbacks) every hook equals the
synchronous ``synchronize`` semantics bit for bit, also where gloo's threads decode; bf16/fp16
gradients work; the fp16/bf16 hooks and
wrappers send half the bytes; the state round-trips through ``torch.save``/``torch.load(
weights_only=True)`` onto a fresh DDP model bit for bit; a peer that leaves fails the step
instead of hanging. The :class:`~tidal.runtime.comm.compressors.Lane` that orders the collectives is
tested on its own."""
import io
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tidal import hooks
from tidal.ir.collectives import new_group
from tidal.runtime.comm.compressors import (Comm, Lane, Message, NoCompression, make_compressor,
                                       synchronize, synchronize_async)
from tidal.runtime.distributed import spawn

BATCH = 8
LR = 0.1
TINY_BUCKETS_MB = 1 / 2**20            # one parameter per DDP bucket: many buckets


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 10), nn.ReLU(), nn.Linear(10, 4)).to(dtype)


def _data(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 12, generator=g).to(dtype), torch.randint(0, 4, (BATCH,),
                                                                         generator=g)


def _shard(rank, size, step, dtype=torch.float32):
    x, y = _data(step, dtype)
    per = BATCH // size
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x).float(), y)


def _sgd(params):
    with torch.no_grad():
        for p in params:
            p -= LR * p.grad


SPECS = {"powersgd": ("powersgd:2,min_compression_rate=0", hooks.powersgd),
         "topk": ("topk:0.3", hooks.topk), "randomk": ("randomk:0.3", hooks.randomk),
         "signsgd": ("signsgd", hooks.signsgd), "qsgd": ("qsgd:4", hooks.qsgd),
         "allreduce": ("none", hooks.allreduce)}


def _ddp_run(rank, size, spec, hook, steps, dtype=torch.float32):
    """``steps`` DDP steps with ``hook`` (tiny buckets); the model, the buckets seen and the
    state."""
    model = _model(dtype)
    ddp = DDP(model, bucket_cap_mb=TINY_BUCKETS_MB)
    state = hooks.HookState(make_compressor(spec), model)
    buckets = set()

    def counted(state, bucket):
        buckets.add(bucket.index())
        return hook(state, bucket)

    ddp.register_comm_hook(state, counted)
    for step in range(steps):
        ddp.zero_grad()
        _loss(ddp, *_shard(rank, size, step, dtype)).backward()
        _sgd(model.parameters())
    return model, len(buckets), state


def _reference(rank, size, spec, steps, dtype=torch.float32):
    """The synchronous semantics: each step's local gradients through ``synchronize``."""
    model, c = _model(dtype), make_compressor(spec)
    for step in range(steps):
        model.zero_grad()
        _loss(model, *_shard(rank, size, step, dtype)).backward()
        synced = synchronize(c, {n: p.grad for n, p in model.named_parameters()}, Comm())
        for n, p in model.named_parameters():
            p.grad = synced[n].to(dtype)
        _sgd(model.parameters())
    return model


def _assert_params(a, b, what, exact=False):
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(dict(a.named_parameters()), dict(b.named_parameters()),
                               msg=lambda m: f"{what}: {m}", **tol)


def _check_returns_before_the_collective(rank, size):
    """Rank 1 starts its backward only once rank 0's first hook has returned, so that hook's
    collective cannot have completed when it returned."""
    signal = new_group()
    model = _model()
    ddp = DDP(model, bucket_cap_mb=TINY_BUCKETS_MB)
    seen = []

    def spy(state, bucket):
        fut = hooks.powersgd(state, bucket)
        if not seen and rank == 0:
            seen.append(fut.done())
            dist.send(torch.zeros(1), 1, group=signal)
        return fut

    ddp.register_comm_hook(hooks.powersgd_state(model, 2, min_compression_rate=0), spy)
    if rank == 1:
        dist.recv(torch.zeros(1), 0, group=signal)
    _loss(ddp, *_shard(rank, size, 0)).backward()
    return seen == [False] if rank == 0 else True


def _check_equal_synchronous(rank, size):
    """Every hook, many buckets, 3 steps: the parameters of the synchronous semantics."""
    for name, (spec, hook) in SPECS.items():
        model, buckets, _ = _ddp_run(rank, size, spec, hook, 3)
        assert buckets > 4, f"want many buckets, got {buckets}"
        _assert_params(model, _reference(rank, size, spec, 3), name, exact=True)
    return True


def _check_half_precision_gradients(rank, size):
    """bf16 and fp16 models: the hooks compute in float32 and write the bucket's dtype."""
    for dtype in (torch.bfloat16, torch.float16):
        for name in ("powersgd", "topk", "allreduce"):
            spec, hook = SPECS[name]
            model, _, _ = _ddp_run(rank, size, spec, hook, 2, dtype)
            assert all(p.dtype == dtype for p in model.parameters())
            _assert_params(model, _reference(rank, size, spec, 2, dtype), f"{name} {dtype}",
                           exact=True)
    return True


def _check_half_precision_payload(rank, size):
    """fp16/bf16 hooks and wrappers: half the bytes of their float32 counterparts, results
    within half precision of them."""
    full, full_state = _ddp_run(rank, size, "none", hooks.allreduce, 2)[::2]
    psgd, psgd_state = _ddp_run(rank, size, SPECS["powersgd"][0], hooks.powersgd, 2)[::2]
    for hook in (hooks.fp16, hooks.bf16):
        half, state = _ddp_run(rank, size, "none", hook, 2)[::2]
        assert state.comm.bytes_sent * 2 == full_state.comm.bytes_sent
        for p, q in zip(half.parameters(), full.parameters()):
            torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)
    # float16's largest value is 65504: the ranks' shares are divided before they are summed
    big = synchronize(NoCompression(), {"g": torch.full((4,), 40000.0)}, Comm(),
                      wire_dtype=torch.float16)["g"]
    assert torch.isfinite(big).all() and torch.allclose(big, torch.full((4,), 40000.0))
    for wrapper in (hooks.fp16_wrapper, hooks.bf16_wrapper):
        half, state = _ddp_run(rank, size, SPECS["powersgd"][0], wrapper(hooks.powersgd), 2)[::2]
        assert state.comm.bytes_sent * 2 == psgd_state.comm.bytes_sent
        for p, q in zip(half.parameters(), psgd.parameters()):
            torch.testing.assert_close(p, q, rtol=5e-2, atol=5e-3)
    return True


def _check_checkpoint(rank, size):
    """Stop after 2 steps, save the hook state with the model, load it with
    ``weights_only=True`` into a fresh model, fresh DDP and a state rebuilt from the file;
    2 more steps equal not stopping, bit for bit (residuals, warm-start Q, step counters)."""
    for name in ("powersgd", "topk", "qsgd"):
        spec, hook = SPECS[name]
        straight = _ddp_run(rank, size, spec, hook, 4)[0]
        model, _, state = _ddp_run(rank, size, spec, hook, 2)
        buf = io.BytesIO()
        torch.save({"hook": state.state_dict(), "model": model.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        fresh = _model()
        fresh.load_state_dict(saved["model"])
        ddp = DDP(fresh, bucket_cap_mb=TINY_BUCKETS_MB)
        ddp.register_comm_hook(hooks.HookState.from_state_dict(saved["hook"], fresh), hook)
        for step in (2, 3):
            ddp.zero_grad()
            _loss(ddp, *_shard(rank, size, step)).backward()
            _sgd(fresh.parameters())
        _assert_params(fresh, straight, f"{name} resumed", exact=True)
    other = _model()                       # the old state on another model: refused, named
    ddp = DDP(other, bucket_cap_mb=TINY_BUCKETS_MB)
    ddp.register_comm_hook(state, hook)
    with pytest.raises(Exception, match="not a parameter of the module"):
        _loss(ddp, *_shard(rank, size, 0)).backward()
    return True


def _on_the_callers_thread(compressor, tensors, comm):
    """The synchronous loop of old: every round waited for and decoded in this thread."""
    world, done = comm.world, {}
    pending = {k: compressor.encode(k, t, world) for k, t in tensors.items()}
    while pending:
        keys = list(pending)
        decoded = [compressor.decode(k, pending[k], r, world)
                   for k, r in zip(keys, comm.run([pending[k] for k in keys]))]
        done.update({k: d for k, d in zip(keys, decoded) if not isinstance(d, Message)})
        pending = {k: d for k, d in zip(keys, decoded) if isinstance(d, Message)}
    return done


def _check_callback_threads_compute_as_the_caller(rank, size):
    """Decoding on gloo's threads gives the caller's bits: MKL rounds a small-K product's edge
    rows differently on a thread whose own thread setting was never made (PowerSGD's
    ``P Q^T`` of a 10 x 768 gradient), which made results depend on which thread ran."""
    comm = Comm()
    for trial in range(20):
        g = torch.Generator().manual_seed(rank)
        grads = {"head.weight": torch.randn(10, 768, generator=g) * 1e-3}
        got = synchronize(make_compressor("powersgd:4"), grads, comm)
        want = _on_the_callers_thread(make_compressor("powersgd:4"), grads, comm)
        assert torch.equal(got["head.weight"], want["head.weight"]), f"trial {trial}"
    return True


def _all_checks(rank, size):
    return [f(rank, size) for f in (_check_callback_threads_compute_as_the_caller,  # first:
                                    _check_returns_before_the_collective,           # fresh
                                    _check_equal_synchronous,                       # threads
                                    _check_half_precision_gradients,
                                    _check_half_precision_payload, _check_checkpoint)]


def test_hooks_on_two_gloo_ranks():
    assert spawn(_all_checks, 2, timeout_s=300) == [[True] * 6] * 2


def _peer_leaves(rank, size):
    """Rank 1 leaves before its backward: rank 0's step fails (every bucket's future completes,
    the queued ones too), it does not wait forever."""
    model = _model()
    ddp = DDP(model, bucket_cap_mb=TINY_BUCKETS_MB)
    ddp.register_comm_hook(hooks.powersgd_state(model, 2, min_compression_rate=0),
                           hooks.powersgd)
    if rank == 1:
        return "left"
    try:
        _loss(ddp, *_shard(rank, size, 0)).backward()
    except Exception as e:  # noqa: BLE001 - the test wants whatever the step raised
        return f"failed: {type(e).__name__}"
    return "no error"


def test_a_peer_that_leaves_fails_the_step_instead_of_hanging():
    out = spawn(_peer_leaves, 2, timeout_s=120, pg_timeout_s=5)
    assert out[1] == "left" and out[0].startswith("failed"), out


# --- single process -----------------------------------------------------------------------------

def test_lane_runs_tasks_in_order_each_after_the_previous_released():
    lane, log, releases = Lane(), [], {}

    def task(i):
        def run(release):
            log.append(f"start {i}")
            releases[i] = release
        return run

    for i in range(3):
        lane.submit(task(i))
    assert log == ["start 0"]                      # 1 and 2 wait for 0's release
    worker = threading.Thread(target=releases[0])   # released from another thread (a callback)
    worker.start()
    worker.join()
    assert log == ["start 0", "start 1"]
    releases[0]()                                  # a second release has no effect
    assert log == ["start 0", "start 1"]
    releases[1]()
    releases[2]()
    lane.submit(task(3))                           # free again: starts at once
    assert log == [f"start {i}" for i in range(4)]


def test_lane_releasing_at_once_does_not_recurse():
    lane, count = Lane(), []
    for _ in range(5000):                          # deeper than Python's recursion limit
        lane.submit(lambda release: (count.append(1), release()))
    assert len(count) == 5000


class _Exploding(NoCompression):
    def decode(self, key, message, reduced, world, out=None):
        raise ArithmeticError(f"cannot decode {key}")


def test_a_decode_error_completes_the_future_and_frees_the_comm():
    comm = Comm()
    fut = synchronize_async(_Exploding(), {"w": torch.ones(3)}, comm)
    with pytest.raises(ArithmeticError, match="cannot decode w"):
        fut.wait()
    assert synchronize(NoCompression(), {"w": torch.ones(3)}, comm)["w"].tolist() == [1.0] * 3


def test_out_receives_the_result_in_its_dtype():
    dest = torch.zeros(4, 3, dtype=torch.bfloat16)
    g = torch.randn(4, 1) @ torch.randn(1, 3)
    c = make_compressor("powersgd:1", min_compression_rate=0)
    out = synchronize_async(c, {"w": g}, out={"w": dest}).wait()
    assert out["w"] is dest
    torch.testing.assert_close(dest, g.to(torch.bfloat16), rtol=2e-2, atol=1e-2)


def test_a_plain_averaging_message_views_the_gradient_until_packed():
    """No copy of the gradient before the collective packs it (the hooks' buffers)."""
    g = torch.randn(5)
    msg = NoCompression().encode("g", g, None)
    assert isinstance(msg, Message) and msg.tensors[0].data_ptr() == g.data_ptr()


@pytest.mark.parametrize("make, match", [
    (lambda: hooks.fp16_wrapper(lambda state, bucket: None), "not one of tidal.hooks"),
    (lambda: hooks.bf16_wrapper(hooks.fp16_wrapper(hooks.powersgd)), "not one of tidal.hooks"),
    (lambda: hooks.hook_for(make_compressor("topk:0.1"), torch.float64), "wire_dtype"),
    (lambda: synchronize(NoCompression(), {"w": torch.ones(2)}, wire_dtype=torch.int8),
     "wire_dtype"),
    (lambda: hooks.HookState.from_state_dict({"name": "topk"}), "has no 'spec'"),
    (lambda: synchronize_async(NoCompression(), {"w": torch.ones(2)}, out={"v": torch.ones(2)}),
     "out names"),
])
def test_bad_input_is_a_clear_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_hook_for_names_and_wrappers():
    assert hooks.hook_for(make_compressor("none")) is hooks.allreduce
    assert hooks.hook_for(make_compressor("powersgd:2"), torch.bfloat16).__name__ == \
        "bf16_powersgd"
    assert set(hooks.HOOKS) == {"powersgd", "topk", "randomk", "signsgd", "qsgd", "none"}
