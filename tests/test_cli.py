"""The tidal CLI as a user runs it: exit codes, one-line errors, report, JSON, dumps.

Most commands run in this process through ``tidal.compiler.cli.main`` (the ``cli`` fixture of
conftest.py, ``cli_inprocess.run_cli``: exit status, stdout and stderr as a process gives
them); ``python -m tidal`` itself runs in a real subprocess in the first two tests."""
import json
import subprocess
from pathlib import Path

import pytest

from cli_inprocess import run_subprocess

ROOT = Path(__file__).resolve().parents[1]


def test_passes_lists_registry():
    r = run_subprocess("passes")  # the entry point, in a process of its own
    assert r.returncode == 0
    from tidal.passes import registry

    for name in registry():
        assert name in r.stdout


def test_bad_input_from_the_entry_point_is_one_line_and_exit_2():
    r = run_subprocess("inspect", "resnet50_small", "--passes", "bogus")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert "unknown pass 'bogus'" in lines[0]


def test_inspect_zoo_model_prints_table_and_json(tmp_path, cli):
    r = cli("inspect", "resnet50_small", "--batch", "4")
    assert r.returncode == 0, r.stderr
    assert "annotate" in r.stdout and "nodes in" in r.stdout
    r = cli("inspect", "resnet50_small", "--batch", "4", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [rec["name"] for rec in data["records"]][:2] == ["trace", "annotate"]
    assert data["records"][0]["nodes_after"] > 10


def test_inspect_file_factory_with_input_shape(tmp_path, cli):
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())\n")
    r = cli("inspect", f"{tmp_path / 'mymodel.py'}:make", "--input-shape", "3,8,8", "--batch", "2")
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
    (["inspect", "resnet50_small", "--input-shape", ""], "argument --input-shape: ''"),
    (["inspect", "resnet50_small", "--input-shape", "1,32,32"],
     "--input-shape 1,32,32 does not fit MODEL 'resnet50_small'"),
    (["inspect", "resnet50_small", "--leaf", "no.such.module"], "no.such.module"),
    (["inspect", "resnet50_small", "--lr", "0"], "--lr"),
    (["inspect", "resnet50_small", "--loss", "hinge"], "--loss"),
    (["simulate", "resnet50_small", "--profile", "/no/such.prof"], "--profile /no/such.prof"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle, cli):
    r = cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]


def test_dump_writes_dot_svg_and_index(tmp_path, cli):
    out = tmp_path / "dump"
    r = cli("dump", "inception_small", "--batch", "2", "--out", str(out))
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


def test_dump_adds_the_scaling_chart(tmp_path, cli):
    out = tmp_path / "dump"
    table = Path(__file__).resolve().parents[1] / "examples/data/scaling/illustrative_steps.csv"
    r = cli("dump", "vgg16_small", "--batch", "8", "--gpus", "4", "--out", str(out), "--scaling",
            str(table))
    assert r.returncode == 0, r.stderr
    assert "scaling.txt" in (out / "index.html").read_text()
    assert "weak" in (out / "scaling.txt").read_text()


def test_help_texts(cli):
    for args in (["--help"], ["inspect", "--help"], ["dump", "--help"], ["run", "--help"],
                 ["whatif", "--help"], ["simulate", "--help"]):
        r = cli(*args)
        assert r.returncode == 0 and "usage" in r.stdout
        assert ">>>" not in r.stdout, args


def _one_error_line(r, needle):
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_dump_to_an_unwritable_directory_is_one_line(tmp_path, cli):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    out = blocker / "dump"
    _one_error_line(cli("dump", "vgg16_small", "--batch", "2", "--out", str(out)), f"--out {out}")


def test_missing_scaling_table_fails_before_the_simulation(tmp_path, cli):
    missing = tmp_path / "steps.csv"
    r = cli("simulate", "vgg16_small", "--gpus", "2", "--scaling", str(missing))
    _one_error_line(r, f"--scaling {missing}")
    assert "simulated" not in r.stdout
    r = cli("dump", "vgg16_small", "--out", str(tmp_path / "d"), "--scaling", str(missing))
    _one_error_line(r, f"--scaling {missing}")


def test_file_inside_a_package_loads_with_its_relative_imports(tmp_path, cli):
    pkg = tmp_path / "mypkg" / "nets"
    pkg.mkdir(parents=True)
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "blocks.py").write_text("import torch\nWIDTH = 4\n")
    (pkg / "net.py").write_text(
        "import torch\n"
        "from .blocks import WIDTH\n"
        "from ..nets import blocks\n"
        "def make():\n"
        "    return torch.nn.Linear(blocks.WIDTH, WIDTH)\n")
    r = cli("inspect", f"{pkg / 'net.py'}:make", "--input-shape", "4", cwd=tmp_path.parent)
    assert r.returncode == 0, r.stderr
    r = cli("inspect", "examples/models/vgg.py:vgg16_small", "--batch", "2")
    assert r.returncode == 0, r.stderr


def test_training_passes_run_from_the_cli(cli):
    r = cli("inspect", "examples/models/vgg.py:vgg16_small", "--passes", "tick_tock", "--gpus",
            "2")
    assert r.returncode == 0, r.stderr
    assert "== tick_tock plan ==" in r.stdout and "2 waves x 2 ranks" in r.stdout
    r = cli("inspect", "resnet50_small", "--passes", "round_robin,compression", "--gpus", "2",
            "--batch", "4", "--optimizer", "adam", "--lr", "0.01")
    assert r.returncode == 0, r.stderr
    assert "== round_robin plan ==" in r.stdout and "== compression plan ==" in r.stdout


def test_auto_considers_the_training_passes_and_says_why_it_skipped_them(cli):
    r = cli("inspect", "vgg16_small", "--passes", "auto", "--gpus", "2")
    assert r.returncode == 0, r.stderr
    assert "auto: skipped tick_tock" in r.stdout  # the report prints compile's notes
    assert "give loss_fn" not in r.stdout  # the CLI gave a loss and an optimizer


def test_training_passes_on_a_model_without_a_loss(tmp_path, cli):
    (tmp_path / "plain.py").write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),\n"
        "                               torch.nn.Linear(8, 3))\n")
    for loss in ("default", "mse"):
        r = cli("inspect", f"{tmp_path / 'plain.py'}:make", "--input-shape", "6", "--passes",
                "compression", "--gpus", "2", "--loss", loss)
        assert r.returncode == 0, r.stderr
        assert "== compression plan ==" in r.stdout
