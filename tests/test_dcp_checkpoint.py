"""A DCP checkpoint of a burst_parallel run on two gloo ranks (owner-only optimizer state: a
rank holds AdamW's state only for the layers it runs) loads on one process, and training goes
on exactly as the two ranks did (float64, ≤ 1e-9): tidal.compiler.checkpoint's get_state_dict
refreshes the stale copies first and keys the optimizer state by parameter name."""
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tidal.compiler import checkpoint
from tidal.runtime.distributed import spawn

from test_open_step_burst import _adamw, _compile, _data, _model

TOL = dict(rtol=1e-9, atol=1e-12)


def _burst_then_save(rank, size, path):
    """Two open steps under burst (c1 on rank 0 only), a DCP checkpoint, a third step; the
    model's state after it (current on every rank)."""
    torch.set_default_dtype(torch.float64)
    model = _model()
    c = _compile(model)
    opt, sched = _adamw(model)
    for step in range(3):
        if step == 2:
            model_state, optim_state = checkpoint.get_state_dict(c, opt)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        c.backward(*_data(step, 0))
        opt.step()
        sched.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in c.state_dict().items()}


def test_a_sharded_burst_checkpoint_resumes_on_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    final = spawn(_burst_then_save, 2, path, timeout_s=300)
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    model = _model()   # one process, plain PyTorch: load, then the third step
    opt, sched = _adamw(model)
    model_state, optim_state = get_state_dict(model, opt)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)
    assert opt.state[model.c1.weight]["step"] == 2     # rank 0's own share came back
    for _ in range(2):
        sched.step()
    x, y = _data(2, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, final[0][k], **TOL, msg=k)
