"""The tidal CLI as a user runs it: exit codes, one-line errors, report, JSON, dumps."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "tidal", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_passes_lists_registry():
    r = run("passes")
    assert r.returncode == 0
    from tidal.passes import registry

    for name in registry():
        assert name in r.stdout


def test_inspect_zoo_model_prints_table_and_json(tmp_path):
    r = run("inspect", "resnet50_small", "--batch", "4")
    assert r.returncode == 0, r.stderr
    assert "annotate" in r.stdout and "nodes in" in r.stdout
    r = run("inspect", "resnet50_small", "--batch", "4", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [rec["name"] for rec in data["records"]][:2] == ["trace", "annotate"]
    assert data["records"][0]["nodes_after"] > 10


def test_inspect_file_factory_with_input_shape(tmp_path):
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())\n")
    r = run("inspect", f"{tmp_path / 'mymodel.py'}:make", "--input-shape", "3,8,8", "--batch", "2")
    assert r.returncode == 0, r.stderr
    assert "trace" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["inspect", "nosuchmodel"], "module:factory"),
    (["inspect", "no_such_module_xyz:make"], "cannot import module"),
    (["inspect", "resnet50_small", "--passes", "bogus"], "unknown pass 'bogus'"),
    (["inspect", "resnet50_small", "--gpus", "0"], "--gpus"),
    (["inspect", "resnet50_small", "--batch", "x"], "--batch"),
    (["inspect", "resnet50_small", "-o", "amp_limit=2"], "amp_limit"),
    (["inspect", "torch.nn:Linear"], "factory raised"),
    (["inspect", "resnet50_small", "--input-shape", "3,a"], "--input-shape"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]


def test_dump_writes_dot_svg_and_index(tmp_path):
    out = tmp_path / "dump"
    r = run("dump", "inception_small", "--batch", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    index = out / "index.html"
    html = index.read_text()
    assert html.index("trace") < html.index("annotate")
    assert list(out.glob("*.dot"))
    if subprocess.run(["which", "dot"], capture_output=True).returncode == 0:
        svgs = list(out.glob("*.svg"))
        assert svgs and "<svg" in svgs[0].read_text()
        assert svgs[0].name in html
    assert "scaling.txt" not in html


def test_dump_adds_the_scaling_chart(tmp_path):
    out = tmp_path / "dump"
    table = Path(__file__).resolve().parents[1] / "examples/data/scaling/illustrative_steps.csv"
    r = run("dump", "vgg16_small", "--batch", "8", "--gpus", "4", "--out", str(out), "--scaling",
            str(table))
    assert r.returncode == 0, r.stderr
    assert "scaling.txt" in (out / "index.html").read_text()
    assert "weak" in (out / "scaling.txt").read_text()


def test_help_texts():
    for args in (["--help"], ["inspect", "--help"], ["dump", "--help"]):
        r = run(*args)
        assert r.returncode == 0 and "usage" in r.stdout
