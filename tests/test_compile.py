"""compile() with no passes is the model; compile() options and errors."""
import copy
import json

import pytest
import torch

import tidal
from examples.models import SMALL_MODELS, ZOO

FULL_MODELS = sorted(set(ZOO) - set(SMALL_MODELS))


def _check_equal(name, batch):
    torch.manual_seed(0)
    model = ZOO[name]().eval()
    inputs = model.example_inputs(batch)
    compiled = tidal.compile(model, inputs)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=0, atol=0)


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_no_pass_compile_equals_eager_small(name):
    _check_equal(name, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL_MODELS)
def test_no_pass_compile_equals_eager_full(name):
    _check_equal(name, 1)


def test_compiled_shares_parameters_and_steps_in_place():
    model = ZOO["resnet50_small"]()
    x, y = model.example_inputs(4), model.example_targets(4)
    compiled = tidal.compile(model, x, loss_fn=model.default_loss,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    reference = ZOO["resnet50_small"]()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        loss = compiled.step(x, y)
        opt.zero_grad()
        ref_loss = reference.default_loss(reference(*x), y)
        ref_loss.backward()
        opt.step()
        torch.testing.assert_close(loss, ref_loss.detach())
    for (k, p), q in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(p, q, msg=k)


def test_step_without_loss_or_optimizer_is_a_clear_error():
    model = torch.nn.Linear(3, 2)
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="loss_fn"):
        tidal.compile(model, x).step(x, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="optimizer"):
        tidal.compile(model, x, loss_fn=torch.nn.functional.cross_entropy).step(
            x, torch.tensor([0, 1]))


def test_unknown_pass_and_option_are_named():
    model, x = torch.nn.Linear(3, 2), torch.randn(2, 3)
    with pytest.raises(tidal.PassError, match="'nope'"):
        tidal.compile(model, x, passes=["nope"])
    with pytest.raises(TypeError, match="'amp_limit'"):
        tidal.compile(model, x, amp_limit=2)


def test_user_pass_object_runs_and_is_reported():
    class DoubleOutput(tidal.Pass):
        """Multiplies the model output by 2."""
        name = "double_output"

        def __call__(self, gm, ctx):
            out = next(n for n in gm.graph.nodes if n.op == "output")
            with gm.graph.inserting_before(out):
                doubled = gm.graph.call_function(torch.mul, (out.args[0], 2))
            out.args = (doubled,)
            return tidal.PassResult(gm, notes=("doubled",))

    model, x = torch.nn.Linear(3, 2), torch.randn(2, 3)
    compiled = tidal.compile(model, x, passes=[DoubleOutput()])
    torch.testing.assert_close(compiled(x), 2 * model(x))
    record = compiled.records[-1]
    assert record.name == "double_output" and record.added == ("mul",)
    report = compiled.report()
    assert "double_output" in report and "doubled" in report
    assert [r.name for r in compiled.records] == ["trace", "annotate", "double_output"]


def test_a_pass_result_has_no_executor():
    # passes emit (graph, plan); the runtime builds the executor from the plan
    with pytest.raises(TypeError, match="executor"):
        tidal.PassResult(torch.fx.symbolic_trace(torch.nn.Linear(3, 2)), executor=object())


def test_alternative_passes_cannot_be_combined_and_auto_keeps_the_first():
    model = ZOO["vgg16_small"]()
    x, y = model.example_inputs(8), model.example_targets(8)
    kw = dict(loss_fn=model.default_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
              cluster=tidal.Cluster(gpus=2))
    with pytest.raises(tidal.PassError, match="alternatives"):
        tidal.compile(model, x, passes=["burst_parallel", "tick_tock"], **kw)
    compiled = tidal.compile(model, x, passes="auto", **kw)
    chosen = [r.name for r in compiled.records[2:]
              if getattr(tidal.passes.registry().get(r.name), "exclusive", "") == "parallelism"]
    assert chosen == ["burst_parallel"]


@pytest.mark.parametrize("name", ["resnet50_small", "llama_small"])
def test_lowered_compile_equals_eager(name):
    model = ZOO[name]().eval()
    x = model.example_inputs(2)
    compiled = tidal.compile(model, x, lower="graphs")
    assert compiled.lowered is not None
    with torch.no_grad():
        torch.testing.assert_close(compiled(*x), model(*x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="lower="):
        tidal.compile(model, x, lower="cuda-graphs")


def test_an_option_two_selected_passes_take_is_ambiguous():
    model = ZOO["bert_small"]()
    x = model.example_inputs(4)
    with pytest.raises(tidal.PassError, match="'mode' is taken by passes"):
        tidal.compile(model, x, passes=["compression", "clustered_attention"], mode="static",
                      loss_fn=model.default_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_lowering_names_an_example_input_on_another_device_than_the_parameters():
    from tidal.runtime.programs.graph import lowered_graph

    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    gm = tidal.trace(model, (torch.randn(2, 4),))
    assert lowered_graph(gm, (torch.randn(2, 4),), "graphs") is not None
    with pytest.raises(ValueError, match=r"example input 'input' is on meta, the model's "
                                         r"parameters on cpu: move it there"):
        lowered_graph(gm, (torch.randn(2, 4, device="meta"),), "graphs")


def test_a_compile_without_plans_runs_its_steps_through_the_one_executor(tmp_path):
    """No plan to run differently: the step is still a program (forward, backward) run by the
    executor, with a trace; equal to eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    c = tidal.compile(model, (x,), passes=[], loss_fn=torch.nn.functional.cross_entropy,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    loss = c.step((x,), y)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = torch.nn.functional.cross_entropy(ref(x), y)
    want.backward()
    opt.step()
    torch.testing.assert_close(loss, want.detach(), rtol=0, atol=0)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert type(c.executor.rank_program).__name__ == "GraphProgram"
    assert [p.name for p in c.executor.last_program.pieces] == ["forward", "backward"]
    trace = json.loads(c.trace(tmp_path / "t.json").read_text())
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} == {"forward", "backward"}
    with pytest.raises(ValueError, match=r"cold_start.*LayerGroups"):
        c.cold_start(tmp_path / "missing.safetensors")
