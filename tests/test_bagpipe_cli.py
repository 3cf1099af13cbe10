"""``tidal inspect MODEL --passes embedding_cache --bagpipe N``: Bagpipe's per-iteration
statistics in the CLI, in ``--json`` and in the dump index. One test spawns a real Bagpipe run
(2 trainers + 1 embedding server + the oracle); the error tests stop before any process
starts."""
import json
from pathlib import Path

import pytest

from tidal.compiler import cli
from tidal.compiler.cli_bagpipe import HEADERS, SECTION

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 4


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the zoo and examples.data.clicks import from the checkout


def _table_rows(out: str) -> list[list[str]]:
    """The rows of the per-iteration table in ``out`` (the lines after its dashes)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("iteration  hit rate"))
    assert lines[start].split() == " ".join(HEADERS).split()
    rows = []
    for line in lines[start + 2:]:
        if not line.strip() or line.startswith("total:"):
            break
        rows.append(line.split())
    return rows


@pytest.mark.slow
def test_inspect_bagpipe_prints_the_per_iteration_table_json_and_dump(tmp_path, capsys,
                                                                      monkeypatch):
    from tidal.compiler.compiled import Compiled

    runs = []
    real = Compiled.bagpipe

    def recording(self, data, iterations, **options):
        runs.append(((iterations, options), real(self, data, iterations, **options)))
        return runs[-1][1]

    monkeypatch.setattr(Compiled, "bagpipe", recording)
    dump = tmp_path / "dump"
    argv = ["inspect", "dlrm_small", "--passes", "embedding_cache", "--bagpipe",
            str(ITERATIONS), "--lookahead", "5", "--zipf-alpha", "1.5"]
    assert cli.main(argv + ["--dump", str(dump)]) == 0
    out, err = capsys.readouterr()
    assert (f"tidal: training {ITERATIONS} iterations with Bagpipe on 2 trainers + 1 "
            f"embedding server (lookahead 5, Zipf alpha 1.5, batch 8) ...") in err
    (iterations, options), = [r[0] for r in runs]
    assert iterations == ITERATIONS and options["trainers"] == 2
    # the report and the plan come first, then the run's table and totals
    assert out.index("== embedding_cache plan ==") < out.index("== Bagpipe: 4 iterations")
    assert "lookahead 5" in out
    rows = _table_rows(out)
    assert [r[0] for r in rows] == [str(i) for i in range(ITERATIONS)]
    assert all(len(r) == len(HEADERS) for r in rows)
    assert float(rows[0][1]) == 0  # nothing is cached before the first batch
    assert max(float(r[1]) for r in rows) > 0
    assert all(int(r[2]) > 0 for r in rows[:1])  # the first batch's rows are all prefetched
    assert "\ntotal: 4 iterations, hit rate " in out
    # the dump's index has the same table in its own section
    index = (dump / "index.html").read_text()
    assert SECTION in index and "bagpipe.txt" in index
    assert (dump / "bagpipe.txt").read_text().splitlines()[1].split() == \
        " ".join(HEADERS).split()
    assert f"dump: {dump / 'index.html'}" in out

    # --json: the same run's stats (the recorded result, no second spawn)
    result = runs[0][1]
    monkeypatch.setattr(Compiled, "bagpipe", lambda self, data, iterations, **o: result)
    assert cli.main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    bp = doc["bagpipe"]
    assert (bp["iterations"], bp["trainers"], bp["servers"], bp["lookahead"],
            bp["zipf_alpha"], bp["batch"]) == (ITERATIONS, 2, 1, 5, 1.5, 8)
    assert [s["iteration"] for s in bp["stats"]] == list(range(ITERATIONS))
    assert [round(s["hit_rate"], 3) for s in bp["stats"]] == [float(r[1]) for r in rows]
    assert {"hits", "lookups", "rows_fetched", "rows_synced_critical",
            "rows_synced_background", "rows_written", "bytes_moved", "bytes_critical",
            "seconds"} <= set(bp["stats"][0])
    assert bp["total"]["hits"] == sum(s["hits"] for s in bp["stats"]) > 0
    assert doc["dump"] is None


@pytest.mark.parametrize("argv, message", [
    (["--bagpipe", "2"], "--bagpipe needs the embedding_cache pass: add --passes "
                         "embedding_cache"),
    (["--passes", "auto", "--bagpipe", "2"], "--bagpipe needs the embedding_cache pass"),
    (["--passes", "embedding_cache", "--trainers", "2"],
     "--trainers only applies to a Bagpipe run: add --bagpipe N"),
    (["--passes", "embedding_cache", "--zipf-alpha", "1.2"],
     "--zipf-alpha only applies to a Bagpipe run"),
    (["--lookahead", "3"], "--lookahead is the embedding_cache pass's lookahead: add "
                           "--passes embedding_cache"),
    (["--passes", "embedding_cache", "--bagpipe", "2", "--batch", "7"],
     "--bagpipe: --batch 7 is not a multiple of 2 trainers"),
    (["--passes", "embedding_cache", "--bagpipe", "2", "--trainers", "3"],
     "--bagpipe: --batch 8 is not a multiple of 3 trainers"),
])
def test_bagpipe_usage_errors_are_one_line_before_compiling(argv, message, capsys,
                                                            monkeypatch):
    import tidal

    monkeypatch.setattr(tidal, "compile", lambda *a, **k: pytest.fail("compiled"))
    assert cli.main(["inspect", "dlrm_small"] + argv) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("tidal inspect: error: ") and message in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_bagpipe_needs_a_positive_iteration_count(value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["inspect", "dlrm_small", "--passes", "embedding_cache", "--bagpipe", value])
    assert e.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "argument --bagpipe" in err and err.count("\n") == 1


def test_bagpipe_needs_a_recommendation_model(capsys, monkeypatch):
    from tidal.compiler.compiled import Compiled

    monkeypatch.setattr(Compiled, "bagpipe", lambda *a, **k: pytest.fail("ran Bagpipe"))
    assert cli.main(["inspect", "llama_small", "--passes", "embedding_cache",
                     "--bagpipe", "2"]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == ""  # checked before the report is printed
    line = err.splitlines()[-1]
    assert line.startswith("tidal inspect: error: --bagpipe needs a recommendation model "
                           "with num_dense and table_rows")
    assert "'llama_small'" in line


def test_inspect_help_shows_the_bagpipe_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["inspect", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--bagpipe N", "--trainers T", "--lookahead L", "--zipf-alpha A",
                 "cache hit rate", "Zipf skew"):
        assert text in out, text


def _record_that_it_ran(path: str) -> str:
    """What a tampered checkpoint's pickle calls: writes ``path`` (so the test can tell)."""
    Path(path).write_text("the checkpoint ran code")
    return "ran"


class _RunsCodeWhenUnpickled:
    """An object whose unpickling calls :func:`_record_that_it_ran`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return _record_that_it_ran, (self.path,)


def test_a_resume_checkpoint_that_would_run_code_is_refused(tmp_path):
    """Issue 35 item 10: ``resume=`` loads with ``weights_only=True``, so a checkpoint holding a
    pickled callable is a ``BagpipeError`` naming the file and nothing in it runs; a real
    checkpoint (tensors, dicts and an int) still loads."""
    import torch

    from tidal.runtime.bagpipe import BagpipeError, load_checkpoint
    from tidal.runtime.bagpipe.trainer import CHECKPOINT_FILE

    good = {"tables": {"t0": torch.arange(6.0).reshape(3, 2)},
            "dense": {"fc.weight": torch.ones(2, 2)}, "next": 3}
    (tmp_path / "good").mkdir()
    torch.save(good, tmp_path / "good" / CHECKPOINT_FILE)
    loaded = load_checkpoint(str(tmp_path / "good"))
    assert loaded["next"] == 3 and torch.equal(loaded["tables"]["t0"], good["tables"]["t0"])

    marker = tmp_path / "ran.txt"
    for name, payload in (("reduce", {**good, "hook": _RunsCodeWhenUnpickled(str(marker))}),
                          ("callable", {**good, "hook": print})):
        (tmp_path / name).mkdir()
        torch.save(payload, tmp_path / name / CHECKPOINT_FILE)
        with pytest.raises(BagpipeError, match="not a Bagpipe checkpoint") as e:
            load_checkpoint(str(tmp_path / name))
        assert CHECKPOINT_FILE in str(e.value)
    assert not marker.exists(), "loading the tampered checkpoint ran its code"
