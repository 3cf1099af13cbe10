"""Bad command lines, generated: every one is exit status 2 and exactly one line on stderr
(``tidal SUBCOMMAND: error: ...``), with no traceback, nothing on stdout and nothing compiled.

Hypothesis draws a few hundred invocations of ``inspect``, ``dump``, ``simulate``, ``whatif``,
``passes``, ``run`` and ``inspect --bagpipe``: one option given a value that option must refuse
(nan, inf, zero, negative, huge and non-numeric numbers, empty strings, garbage shapes such as
``long[-5]:5`` or ``3,,4``, unknown choices and options), after a few valid options. They run in
this process (``cli_inprocess.run_cli``), derandomized so that CI sees the same cases every run;
``tidal.compile`` is replaced by a function that fails the test, so an invalid invocation that
reached a compile would show. The issue's own cases (issue 35, item 7) are listed by name below
the fuzz test, and a last test checks that a bug inside a compile is still a traceback.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cli_inprocess import run_cli

FUZZ_EXAMPLES = 300
GARBAGE = st.text(alphabet="abcdgh,;:[]!@# ", max_size=8)  # no digit, e, i, n, f: no number
HUGE = st.integers(min_value=2**31, max_value=10**40).map(str)


def _floats(low_ok: bool) -> st.SearchStrategy[str]:
    """Text a finite-number option refuses: > 0 (``low_ok`` False) or >= 0 (True)."""
    below = st.floats(max_value=-1e-300, allow_nan=False) if low_ok else \
        st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)
    return st.one_of(st.sampled_from(["nan", "NaN", "inf", "-inf", "Infinity", "1e400",
                                      "-1e400", "", " ", "1,5", "0x10", "1.2.3"]),
                     below.map(repr), GARBAGE)


POSITIVE_FLOAT = _floats(low_ok=False)
NON_NEGATIVE_FLOAT = _floats(low_ok=True)


def _ints(low: int) -> st.SearchStrategy[str]:
    """Text an integer option with minimum ``low`` refuses."""
    return st.one_of(st.integers(max_value=low - 1).map(str), HUGE,
                     st.sampled_from(["", "x", "1.5", "1e30", "nan", "inf", "9" * 60, "2 3"]),
                     GARBAGE)


POSITIVE_INT = _ints(1)
NON_NEGATIVE_INT = _ints(0)
SHAPE = st.one_of(st.sampled_from([
    "long[-5]:5", "long[0]:5", "long[x]:5", "long[5]:", "long:", ":", "float32:3", "int:3",
    "3,,4", ",3", "3,", "x", "", "3,-1", "3,0", "0", "-3", "3,100000,100000", "100000x100000",
    "long[99999999999999]:3", "3.5,2", "1e9,1e9"]), GARBAGE)
OPTION = st.sampled_from(["x", "=1", "1x=2", "a b=1", "amp_limit=NaN", "amp_limit=Infinity",
                          "amp_limit=-Infinity", "amp_limit=1e400", "nosuchoption=1",
                          "lr=" + "[" * 5000 + "]" * 5000,
                          "mode=" + "m" * 100_000])
BANDWIDTH = st.one_of(st.sampled_from(["fast", "0", "0Gbps", "-1", "1e400Gbps", "nan", "inf",
                                       "", "10Xbps", "10 G bps"]), GARBAGE)
PERCENT = st.one_of(st.sampled_from(["nan", "-1", "-1%", "x", "", "inf%", "1e400", "%"]),
                    GARBAGE)
INT_LIST = st.one_of(st.sampled_from(["0", "1,,2", "", "x", "-1,2", "1e30", "8,0",
                                      ",".join(["8"] * 3) + ",99999999999"]), GARBAGE)
UNKNOWN = st.sampled_from(["--no-such-option", "--xyz=1", "-Q", "--batchsize=3"])
BLANK = st.sampled_from(["", " ", "\t"])


def _bad(*options_and_values: tuple[str, st.SearchStrategy[str]]) -> st.SearchStrategy:
    """One of ``(option, values)``, as the argument ``OPTION=VALUE``."""
    return st.one_of(*(values.map(lambda v, o=o: [f"{o}={v}"])
                       for o, values in options_and_values))


MODEL_OPTIONS = (
    ("--batch", POSITIVE_INT), ("--gpus", POSITIVE_INT), ("--input-shape", SHAPE),
    ("--bandwidth-gbps", POSITIVE_FLOAT), ("--latency-us", NON_NEGATIVE_FLOAT),
    ("--memory-gb", POSITIVE_FLOAT), ("--amp-limit", POSITIVE_FLOAT), ("--lr", POSITIVE_FLOAT),
    ("--leaf", BLANK), ("--option", OPTION), ("--loss", st.sampled_from(["hinge", "", "MSE"])),
    ("--optimizer", st.sampled_from(["lbfgs", "", "SGD"])),
    ("--passes", st.sampled_from(["bogus", "tick_tock,bogus", "burst parallel"])),
)
SIMULATE_OPTIONS = MODEL_OPTIONS + (
    ("--global-batch", POSITIVE_INT), ("--peak-tflops", POSITIVE_FLOAT),
    ("--interference", POSITIVE_FLOAT), ("--bg-batch", POSITIVE_INT),
    ("--plan", st.sampled_from(["foo", "", "burst+"])),
    ("--profile", st.sampled_from(["/no/such.prof", "/no/such.json"])),
)
WHATIF_OPTIONS = (
    ("--batch", POSITIVE_INT), ("--gpus", POSITIVE_INT), ("--bandwidth", BANDWIDTH),
    ("--latency-us", NON_NEGATIVE_FLOAT), ("--encode-ms", NON_NEGATIVE_FLOAT),
    ("--tflops", POSITIVE_FLOAT), ("--bucket-mb", POSITIVE_FLOAT), ("--gamma", POSITIVE_FLOAT),
    ("--sweep", st.one_of(BANDWIDTH, st.sampled_from(["1,,2", "1,nan", "10,0"]))),
    ("--near-linear", PERCENT), ("--ratio-batches", INT_LIST),
    ("--compressor", st.sampled_from(["zip:1", "powersgd:0", "topk:2", "", "qsgd:x"])),
    ("--model", st.sampled_from(["", "nosuchmodel", "no_such_module_xyz:make"])),
)
BAGPIPE_OPTIONS = (
    ("--bagpipe", POSITIVE_INT), ("--trainers", POSITIVE_INT),
    ("--lookahead", NON_NEGATIVE_INT), ("--zipf-alpha", POSITIVE_FLOAT),
)
VALID_MODEL_ARGS = st.lists(st.sampled_from(["--batch=2", "--gpus=2", "--lr=0.5",
                                             "--latency-us=0", "--loss=mse"]),
                            max_size=2, unique=True)


def _invocations(out_dir: str) -> st.SearchStrategy[list[str]]:
    """A bad ``tidal`` command line: subcommand, valid arguments, then one bad one."""
    model = ["resnet50_small"]
    return st.one_of(
        st.tuples(st.just(["inspect", *model]), VALID_MODEL_ARGS,
                  st.one_of(_bad(*MODEL_OPTIONS), UNKNOWN.map(lambda u: [u]))),
        st.tuples(st.just(["dump", *model, f"--out={out_dir}"]), VALID_MODEL_ARGS,
                  st.one_of(_bad(*MODEL_OPTIONS),
                            st.just(["--scaling=/no/such/steps.csv"]))),
        st.tuples(st.just(["simulate", *model]), VALID_MODEL_ARGS, _bad(*SIMULATE_OPTIONS)),
        st.tuples(st.just(["whatif"]), st.lists(st.sampled_from(["--batch=8", "--gpus=4"]),
                                                max_size=1), _bad(*WHATIF_OPTIONS)),
        st.tuples(st.just(["inspect", "dlrm_small", "--passes=embedding_cache"]),
                  st.just([]), _bad(*BAGPIPE_OPTIONS)),
        st.tuples(st.just(["passes"]), st.just([]),
                  st.sampled_from([["--xyz"], ["extra"], ["-n=2"]])),
        st.tuples(st.just(["run"]), st.just([]),
                  st.one_of(POSITIVE_INT.map(lambda n: [f"-n={n}", "train.py"]),
                            st.just(["-n=2", "/no/such/script.py"]), st.just(["-n=2", ""]),
                            st.just(["train.py"]))),
    ).map(lambda parts: [*parts[0], *parts[1], *parts[2]])


@pytest.fixture
def no_compile(monkeypatch):
    """``tidal.compile`` fails the test: an invalid command line must stop before it."""
    import tidal
    from tidal.compiler import api

    def refuse(*args, **kwargs):
        raise AssertionError("an invalid command line reached tidal.compile")

    monkeypatch.setattr(tidal, "compile", refuse)
    monkeypatch.setattr(api, "compile", refuse)


def _assert_one_line_exit_2(r) -> None:
    assert r.returncode == 2, (r.args, r.returncode, r.stdout[-500:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, (r.args, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tidal") and ": error: " in lines[0], \
        (r.args, r.stderr)
    assert len(lines[0]) < 2000, (r.args, "an error line that long echoes its input whole")
    assert r.stdout == "", (r.args, r.stdout)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_bad_command_lines_are_one_line_and_exit_2(data, capfd, tmp_path, no_compile):
    argv = data.draw(_invocations(str(tmp_path / "dump")), label="argv")
    event(" ".join(argv[:2] if argv[0] in ("inspect", "dump", "simulate") else argv[:1]))
    _assert_one_line_exit_2(run_cli(capfd, argv, cwd=tmp_path))
    assert not (tmp_path / "dump").exists(), argv


ISSUE_CASES = [  # issue 35 item 7: each was a traceback or accepted
    (["inspect", "resnet50_small", "--input-shape", "3,100000,100000"], "too large"),
    (["inspect", "resnet50_small", "--batch", "1000000000000"], "--batch"),
    (["inspect", "resnet50_small", "--batch", "100000"], "too large: 307,200,000 elements"),
    (["inspect", "resnet50_small", "--input-shape", "long[0]:5"], "long[N]"),
    (["inspect", "resnet50_small", "--input-shape", "long[-5]:5"], "long[N]"),
    (["whatif", "--tflops", "0"], "--tflops"),
    (["whatif", "--latency-us", "nan"], "--latency-us"),
    (["whatif", "--encode-ms", "-1"], "--encode-ms"),
    (["whatif", "--gamma", "-1"], "--gamma"),
    (["whatif", "--bandwidth", "1e400Gbps"], "--bandwidth"),
    (["inspect", "resnet50_small", "--bandwidth-gbps", "inf"], "--bandwidth-gbps"),
    (["inspect", "resnet50_small", "--lr", "inf"], "--lr"),
    (["inspect", "resnet50_small", "--leaf", ""], "--leaf"),
    (["inspect", "resnet50_small", "--passes", "burst_parallel", "--amp-limit", "0.5"],
     "amp_limit"),
    (["whatif", "--model", "torch.nn:Linear"], "factory raised"),
]


@pytest.mark.parametrize("argv, needle", ISSUE_CASES)
def test_the_reported_command_lines_are_one_line_and_exit_2(argv, needle, capfd, tmp_path,
                                                            no_compile):
    r = run_cli(capfd, argv, cwd=tmp_path)
    _assert_one_line_exit_2(r)
    assert needle in r.stderr, r.stderr


def test_a_bug_inside_the_compile_is_still_a_traceback(capfd, monkeypatch):
    """Only the input stage turns Python errors into one line: a ``ValueError`` raised by the
    compile itself (a bug in a pass) is a traceback and exit status 1."""
    import tidal

    def buggy(*args, **kwargs):
        raise ValueError("a bug deep inside a pass")

    monkeypatch.setattr(tidal, "compile", buggy)
    r = run_cli(capfd, ["inspect", "resnet50_small", "--batch", "2"])
    assert r.returncode == 1 and "Traceback" in r.stderr, (r.returncode, r.stderr)
    assert "a bug deep inside a pass" in r.stderr
