"""The CLI starts without torch, the public names of ``tidal`` load lazily, ``tidal.hooks`` is a
module, and the pass registry describes passes without importing them."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "sympy", "networkx")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_help_and_passes_import_no_torch():
    r = _python(f"""
        import contextlib, io, sys
        import tidal.compiler.cli as cli
        for argv in (["--help"], ["run", "--help"], ["simulate", "--help"], ["whatif", "--help"],
                     ["inspect", "--help"], ["passes"]):
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    status = cli.main(argv)
                except SystemExit as e:
                    status = e.code
            assert status == 0, (argv, status)
        loaded = [m for m in {HEAVY!r} if m in sys.modules]
        assert not loaded, loaded
    """)
    assert r.returncode == 0, r.stderr


def test_tidal_public_names_load_lazily():
    r = _python("""
        import sys
        import tidal
        assert tidal.__version__ and "torch" not in sys.modules
        assert "compile" in dir(tidal) and "Cluster" in dir(tidal)
        for name in tidal.__all__:
            assert getattr(tidal, name) is not None, name
        from tidal import Cluster, compile, TidalError
        assert tidal.Cluster is Cluster and tidal.passes is sys.modules["tidal.passes"]
        try:
            tidal.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("tidal.no_such_name did not raise")
    """)
    assert r.returncode == 0, r.stderr


def test_hooks_is_an_importable_module():
    import importlib

    import tidal
    from tidal.runtime.comm import ddp_hooks

    hooks = importlib.import_module("tidal.hooks")
    from tidal.hooks import powersgd, powersgd_state  # noqa: F401

    assert tidal.hooks is hooks is sys.modules["tidal.hooks"]
    assert hooks.powersgd is ddp_hooks.powersgd and hooks.topk_state is ddp_hooks.topk_state
    public = {n for n in vars(ddp_hooks) if not n.startswith("_")
              and getattr(getattr(ddp_hooks, n), "__module__", None) == ddp_hooks.__name__}
    assert public <= set(hooks.__all__), public - set(hooks.__all__)


def test_pass_descriptions_agree_with_the_classes():
    from tidal.passes import descriptions, registry, summary

    reg = registry()
    assert set(descriptions()) == set(reg)
    for name, cls in reg.items():
        assert cls.name == name
        assert descriptions()[name] == summary(cls.__doc__), name


def test_passes_prints_whole_sentences(capsys):
    from tidal.compiler.cli import main
    from tidal.passes import descriptions

    assert main(["passes"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "``" not in text  # docstring markup is not printed
    for name, description in descriptions().items():
        assert f"{name} {description.replace('``', '')}" in text
        assert description.endswith(".")


@pytest.mark.parametrize("command", ["run", "whatif", "simulate"])
def test_subcommand_help_is_for_users(command, capsys):
    from tidal.compiler.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tidal {command}")
    assert ">>>" not in out and "_SUBCOMMANDS" not in out and "Wir" not in out
