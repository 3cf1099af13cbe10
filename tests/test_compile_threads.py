"""``tidal.compile`` from several threads at once: fx tracing patches ``torch.nn.Module``
process-wide, so without ``tidal.ir.trace_lock`` one thread's cost model ran its modules into
another thread's tracer ("module is not installed as a submodule"). Every compile must succeed
and give the graph and plan of the same compile made alone."""
import threading

import pytest
import torch

import tidal

THREADS = 4
ROUNDS = 2


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _conv():
    return torch.nn.Sequential(torch.nn.Conv1d(3, 4, 3), torch.nn.Flatten(),
                               torch.nn.Linear(24, 2))


def _norm():
    return torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.GELU())


MODELS = {"mlp": (_mlp, (4, 8)), "conv": (_conv, (4, 3, 8)), "norm": (_norm, (4, 8))}


def _compile(name, passes):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make()
    c = tidal.compile(model, (torch.randn(*shape),), passes=passes)
    plan = c.plan.to_json() if passes else None
    return c.graph_module.code, plan


def _in_threads(jobs):
    """Run ``jobs`` (callables) in ``len(jobs)`` threads started together, ``ROUNDS`` times;
    return each job's results and every exception raised."""
    results = [[] for _ in jobs]
    errors = []
    start = threading.Barrier(len(jobs))

    def run(i):
        try:
            start.wait()
            for _ in range(ROUNDS):
                results[i].append(jobs[i]())
        except Exception as e:  # noqa: BLE001 - collected and reported by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a compile thread hung"
    return results, errors


@pytest.mark.parametrize("passes", [[], ["layer_groups"]])
def test_the_same_model_compiled_from_several_threads(passes):
    alone = _compile("mlp", passes)
    results, errors = _in_threads([lambda: _compile("mlp", passes)] * THREADS)
    assert not errors, errors[0]
    assert all(r == alone for rs in results for r in rs)
    assert sum(len(rs) for rs in results) == THREADS * ROUNDS


@pytest.mark.parametrize("passes", [[], ["layer_groups"]])
def test_different_models_compiled_from_several_threads(passes):
    names = ["mlp", "conv", "norm", "mlp"]
    alone = {n: _compile(n, passes) for n in MODELS}
    results, errors = _in_threads([lambda n=n: _compile(n, passes) for n in names])
    assert not errors, errors[0]
    for name, rs in zip(names, results):
        assert len(rs) == ROUNDS and all(r == alone[name] for r in rs), name


def test_a_compile_in_one_thread_runs_while_none_other_traces():
    """The lock is re-entrant and released: a trace inside a compile, then a compile from
    another thread, both finish."""
    from tidal.ir.trace_lock import tracing
    with tracing():
        first = _compile("mlp", [])
    results, errors = _in_threads([lambda: _compile("mlp", [])])
    assert not errors and results[0][0] == first
