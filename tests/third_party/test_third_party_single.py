"""The third-party matrix in one process: every model (Hugging Face classes from small configs,
plain torch.nn models) under every pass and ``passes="auto"``. Forward equals eager; where the
pass's single-process step is the plain step, one ``Compiled.step`` equals one eager SGD step
(loss and every parameter); tick_tock's first step applies the tick wave's gradient; a pass that
cannot apply raises the recorded clear error; known bugs are strict xfails (``matrix.EXPECTED``).
"""
import importlib.util

import pytest

from tidal.ir.export_capture import ExportCache, reusing_exports

from .matrix import EQUAL, PASSES, Bug, Refuse, check_recompile, check_single, expected
from .models import BUILDERS

HF = importlib.util.find_spec("transformers") is not None
NN = {"nn_transformer", "nn_lstm", "nn_mha"}


def _params(columns):
    out = []
    for m in BUILDERS:
        for p in columns:
            want = expected(m, p)
            marks = [] if HF or m in NN else [pytest.mark.skip(reason="needs the hf extra")]
            if isinstance(want, Bug):
                marks.append(pytest.mark.xfail(strict=True, reason=f"bug: {want.reason}"))
            out.append(pytest.param(m, p, marks=marks, id=f"{m}-{p}"))
    return out


def _check(fn, model_name, pass_name):
    want = expected(model_name, pass_name)
    if isinstance(want, Refuse):
        with pytest.raises(want.error, match=want.match):
            fn()
    else:
        assert want == EQUAL or isinstance(want, Bug)
        fn()


@pytest.fixture(scope="module")
def exports():
    """The exports of this module's tests: each model is exported by its recompile check
    (which runs first, and exports every time) and the cells rebuild that export on their own
    fresh model (``tidal.ir.export_capture.reusing_exports``: its key sees the whole module
    tree, the config and the input signature)."""
    return ExportCache()


@pytest.mark.parametrize("model_name,pass_name", _params(["recompile"]))
def test_compiling_leaves_the_model_as_it_was(model_name, pass_name, exports):
    _check(lambda: check_recompile(model_name, exports), model_name, pass_name)


@pytest.mark.parametrize("model_name,pass_name", _params(PASSES))
def test_single_process(model_name, pass_name, exports):
    with reusing_exports(exports):
        _check(lambda: check_single(model_name, pass_name), model_name, pass_name)
