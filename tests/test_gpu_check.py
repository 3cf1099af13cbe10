"""The ``make gpu-check`` harness (``benchmarks/gpu_check``): a check runs through the driver in
a subprocess and leaves its JSON line and table row; a check past its time limit is killed and
recorded, and the next one still runs, the exit status saying so at the end; the table renders
from JSON lines alone; the wheel list reads setup.cfg's pin and the transformers wheel's
requirements; tidal is imported through the link folder, with no install."""
from __future__ import annotations

import doctest
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpu_check import CHECKS, child, common, driver, table, wheels
from benchmarks.gpu_check.cuda_tests import counts


def _records(out) -> list[dict]:
    return table.read_jsonl(out / "checks.jsonl")


def test_one_check_through_the_driver_writes_its_json_line(tmp_path, capsys):
    rc = driver.main(["--device", "cpu", "--only", "ddp_hook", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().out
    [rec] = _records(tmp_path)
    assert rec["name"] == "ddp_hook" and rec["ok"] and rec["error"] is None
    assert rec["device"] == "cpu" and rec["quick"] and not rec["timed_out"]
    assert 0 < rec["seconds"] <= rec["limit_s"]
    figures = rec["figures"]
    assert figures["backend"] == "gloo" and "failures" not in figures
    assert figures["allreduce.max_dparam"] == 0.0 and figures["plain.ms"] > 0
    md = (tmp_path / "table.md").read_text()
    assert "| ddp_hook | ok |" in md and "backend=gloo" in md
    printed = capsys.readouterr().out
    assert "[1/1] ddp_hook: running" in printed and "[1/1] ddp_hook: ok" in printed


def test_a_check_past_its_limit_is_killed_and_the_next_still_runs(tmp_path, capsys):
    rc = driver.main(["--device", "cpu", "--only", "environment,train_step", "--out",
                      str(tmp_path), "--limit-s", "0.3"])
    assert rc == 1  # non-zero, after both ran
    recs = _records(tmp_path)
    assert [r["name"] for r in recs] == ["environment", "train_step"]
    for r in recs:
        assert r["timed_out"] and not r["ok"] and "time limit of 0 s reached" in r["error"]
        assert r["seconds"] < 10
    assert "FAILED: time limit" in (tmp_path / "table.md").read_text()
    assert "0/2 checks ok; failed: environment, train_step" in capsys.readouterr().out


def test_total_budget_spent_is_recorded_not_run(tmp_path):
    assert driver.main(["--device", "cpu", "--only", "environment", "--out", str(tmp_path),
                        "--total-s", "1"]) == 1
    [rec] = _records(tmp_path)
    assert rec["error"] == "not run: the total time budget was spent" and rec["seconds"] == 0


def test_unknown_check_and_parallel_gpu_checks_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown check.*'nope'"):
        driver.main(["--only", "nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="one check at a time on cuda"):
        driver.main(["--device", "cuda", "--jobs", "2", "--out", str(tmp_path)])


def test_a_check_that_raises_or_cannot_import_is_a_failed_record():
    rec = child.run_check("no_such_check", "cpu", True)
    assert not rec["ok"] and rec["error"].startswith("cannot import the check: ")
    rec = child.record("x", {"a": 1, "failures": ["too slow"]}, None, ("a",))
    assert not rec["ok"] and rec["error"] == "too slow" and rec["summary"] == ["a"]


def test_every_check_module_has_run_and_summary():
    import importlib

    for name, limit in CHECKS:
        module = importlib.import_module(f"benchmarks.gpu_check.{name}")
        assert callable(module.run) and isinstance(module.SUMMARY, tuple) and limit > 0


def test_table_renders_from_json_lines(tmp_path):
    lines = [
        {"name": "environment", "ok": True, "seconds": 3.21, "summary": ["gpu", "torch"],
         "figures": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130"}, "error": None},
        {"name": "train_step", "ok": True, "seconds": 41.0, "summary": ["b32.tidal.ms", "gone"],
         "figures": {"b32.tidal.ms": 0.123456, "b32.eager.ms": 2.0}, "error": None},
        {"name": "antman_cap", "ok": False, "seconds": 2.5, "summary": [], "figures": {},
         "error": "RuntimeError: a | b"},
    ]
    path = tmp_path / "checks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    md = table.render_file(path, date="2026-12-01 10:00 UTC", device="cuda",
                           out=tmp_path / "table.md")
    head, _, body = md.partition("\n\n")
    assert head == ("GPU: NVIDIA H100 80GB HBM3; torch 2.11.0+cu130; device cuda; "
                    "2026-12-01 10:00 UTC")
    rows = body.splitlines()
    assert rows[:2] == ["| check | result | s | figures |", "|---|---|---|---|"]
    assert rows[3] == "| train_step | ok | 41 | b32.tidal.ms=0.123 |"
    assert rows[4] == "| antman_cap | FAILED: RuntimeError: a / b | 2.5 |  |"
    assert (tmp_path / "table.md").read_text() == md + "\n"


def test_table_without_an_environment_record_says_unknown():
    md = table.render([], date="d", device="cpu", quick=True)
    assert md.startswith("GPU: unknown; torch unknown; device cpu; d; quick (tiny sizes)")


def test_wheels_read_the_pin_and_the_wheel_requirements(tmp_path):
    cfg = tmp_path / "setup.cfg"
    cfg.write_text("[options]\ninstall_requires =\n    torch>=2.4\n    pydot\n"
                   "[options.extras_require]\nhf =\n    transformers==9.9.9\n")
    assert wheels.pinned("hf", "transformers", cfg) == "==9.9.9"
    assert wheels.pinned("", "pydot", cfg) == ""
    with pytest.raises(KeyError, match="tokenizers"):
        wheels.pinned("hf", "tokenizers", cfg)
    whl = tmp_path / "transformers-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("transformers-9.9.9.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: transformers\nVersion: 9.9.9\n"
                   "Requires-Dist: huggingface-hub (<1.0,>=0.24.0)\n"
                   "Requires-Dist: tokenizers<0.22,>=0.21\n"
                   "Requires-Dist: tokenizers<0.30; extra == \"dev\"\n\n")
    assert wheels.requirement_of(whl, "tokenizers") == "<0.22,>=0.21"
    assert wheels.requirement_of(whl, "huggingface_hub") == "<1.0,>=0.24.0"
    assert wheels.requirement_of(whl, "numpy") is None


def test_checks_see_tidal_through_the_link_folder_and_the_folder_goes(tmp_path):
    site = tmp_path / "site"
    with driver.import_path(site) as entries:
        assert entries[0] == str(site) and entries[2] == str(driver.ROOT)
        env = driver.child_env(entries)
        assert env["PYTHONPATH"].startswith(str(site)) and env["HF_HUB_OFFLINE"] == "1"
        code = "import tidal, os; print(os.path.dirname(tidal.__file__))"
        where = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=tmp_path,
                               capture_output=True, text=True, check=True).stdout.strip()
        assert where == entries[1] + "/tidal"
    assert not Path(entries[1]).exists()


def test_pytest_counts_from_the_summary_or_from_the_lines_of_a_stopped_run():
    assert counts("..\n3 passed, 1 skipped, 2 deselected in 1.0s\n") == {
        "passed": 3, "failed": 0, "skipped": 1, "errors": 0, "deselected": 2}
    assert counts("F\n1 failed, 2 errors in 0.1s") == {"passed": 0, "failed": 1, "skipped": 0,
                                                        "errors": 2}
    stopped = ("tests/test_a.py::test_x PASSED [ 10%]\ntests/test_a.py::test_y[1] FAILED [ 20%]\n"
               "tests/test_b.py::test_z SKIPPED (needs a CUDA device) [ 30%]\n")
    assert counts(stopped) == {"passed": 1, "failed": 1, "skipped": 1, "errors": 0}
    assert counts("") == {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}


@pytest.mark.parametrize("module", [common, table, wheels])
def test_docstring_examples(module):
    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.mark.cuda
def test_environment_check_names_the_gpu(tmp_path):
    assert driver.main(["--device", "cuda", "--only", "environment", "--out",
                        str(tmp_path)]) == 0
    [rec] = _records(tmp_path)
    assert rec["figures"]["gpu"].startswith(("NVIDIA", "AMD")) and rec["figures"]["gpus"] >= 1
    assert not rec["quick"]
