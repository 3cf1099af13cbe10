"""The third-party matrix on 2 gloo ranks: for burst_parallel, round_robin and compression (off,
and Top-K at 100 %), one training step equals one single-process SGD step on the same global
batch (loss and every parameter) and both ranks hold identical parameters; a refusal is the
recorded clear error. One spawned job runs every model's cells (``matrix.run_models``: the
ranks start once, not once per model); each model's test then reads its own results.
burst_parallel keeps owner-only state, so there the parameters compared are each rank's copies
of those it owns and, for the others, its owners' copies (``matrix.burst_owned``,
``matrix._owners_view``): owners that disagree still differ between the ranks."""
import importlib.util
import re
from typing import Optional

import numpy as np
import pytest

from background_jobs import Job
from .matrix import MULTI_RANK, Bug, Refuse, expected, run_models
from .models import BUILDERS

HF = importlib.util.find_spec("transformers") is not None
NN = {"nn_transformer", "nn_lstm", "nn_mha"}
LOSS_TOL = 1e-5
PARAM_TOL = 1e-5  # max |p - p_ref| / (1 + max |p_ref|), float32


def check_rank_results(model_name, results):
    """Compare every cell of the ranks' results with ``EXPECTED_RANKS``; returns the failures
    as {cell: message} (empty: all as expected)."""
    failures = {}
    for cell in MULTI_RANK:
        want = expected(model_name, cell, ranks=True)
        got = [r[cell] for r in results]
        if isinstance(want, Refuse):
            ok = all(g[0] == "error" and g[1] == want.error.__name__
                     and re.search(want.match, g[2]) for g in got)
            if not ok:
                failures[cell] = f"expected {want.error.__name__} /{want.match}/, got {got[0][:3]}"
            continue
        if any(g[0] == "error" for g in got):
            failures[cell] = f"raised {got[0][1:3] if got[0][0] == 'error' else got[1][1:3]}"
            continue
        bad = [f"rank {r}: loss error {g[1]:.2e}, parameter error {g[2]:.2e}"
               for r, g in enumerate(got) if not (g[1] <= LOSS_TOL and g[2] <= PARAM_TOL)]
        spread = float(max(np.abs(g[3] - got[0][3]).max() for g in got))
        if spread != 0.0:
            bad.append(f"parameters differ between ranks by {spread:.2e}")
        if bad:
            failures[cell] = "; ".join(bad)
    return failures


def _params():
    out = []
    for m in BUILDERS:
        marks = [] if HF or m in NN else [pytest.mark.skip(reason="needs the hf extra")]
        bugs = [c for c in MULTI_RANK if isinstance(expected(m, c, ranks=True), Bug)]
        if bugs:
            reasons = "; ".join(expected(m, c, ranks=True).reason for c in bugs)
            marks.append(pytest.mark.xfail(strict=True, reason=f"bug: {reasons}"))
        out.append(pytest.param(m, marks=marks, id=m))
    return out


TEST_NAME = "test_two_ranks_step_equals_one_process_step"


def background_job(items) -> Optional[Job]:
    """The 2-rank job of the models among ``items`` (this module's collected tests, not
    skipped), one spawned job for all of them; run in the background while the other test
    modules run (``tests/conftest.py``)."""
    names = []
    for item in items:
        if getattr(item, "originalname", None) == TEST_NAME and \
                item.get_closest_marker("skip") is None:
            name = item.callspec.params["model_name"]
            if name not in names:
                names.append(name)
    return Job(run_models, 2, (names,), {"timeout_s": 120 + 60 * len(names)}) if names else None


@pytest.fixture(scope="module")
def rank_results(request, background_jobs):
    """Every multi-rank cell of the models this session runs (not skipped), from one spawned
    2-rank job (:func:`background_job`): {model name: per-rank results}, or the job's
    ``RankError`` (raised by each model's test, so that every one of them fails, inside its
    test)."""
    job = background_job([i for i in request.session.items
                          if getattr(i, "module", None) is request.module])
    try:
        results = background_jobs.result(request.module.__name__, job)
    except Exception as e:  # noqa: BLE001 - re-raised by every test below
        return e
    return {name: [r[name] for r in results] for name in job.args[0]}


@pytest.mark.parametrize("model_name", _params())
def test_two_ranks_step_equals_one_process_step(model_name, rank_results):
    if isinstance(rank_results, Exception):
        raise rank_results.with_traceback(None)  # the same error for every model
    failures = check_rank_results(model_name, rank_results[model_name])
    assert not failures, failures
