"""``make gpu-wheels``: the wheels a GPU machine with no network needs, downloaded here.

The GPU machines have torch, numpy, sympy, networkx, tqdm, pytest and hypothesis, and another
transformers than tidal pins. This downloads, for CPython 3.12 on x86-64 Linux
(``--only-binary=:all: --no-deps``), into ``.whl/``: pydot (and the pyparsing it asks for),
the transformers of setup.cfg's ``hf`` extra, and the tokenizers and huggingface_hub it
accepts (read from that wheel's metadata; the oldest that matches). ``make gpu-check``
installs them with ``pip install --no-index --no-deps --target`` and puts that folder first on
the path.

    python -m benchmarks.gpu_check.wheels [--dest .whl] [--python-version 3.12]

Example (reading the pin only):
    >>> from benchmarks.gpu_check.wheels import pinned
    >>> pinned("hf", "transformers").startswith("==")
    True
"""
from __future__ import annotations

import argparse
import configparser
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), 1)[0]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(extra: str, name: str, setup_cfg: Path = ROOT / "setup.cfg") -> str:
    """The version specifier of ``name`` in setup.cfg's ``extra`` (``"==4.47.1"``), or of
    ``install_requires`` when ``extra`` is empty ('' when unpinned). ``KeyError`` when the
    project does not require it there."""
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg)
    text = (cfg["options.extras_require"][extra] if extra
            else cfg["options"]["install_requires"])
    for line in text.splitlines():
        if line.strip() and _norm(_name(line)) == _norm(name):
            return line.strip()[len(_name(line)):].strip()
    raise KeyError(f"setup.cfg: {name} is not in {extra or 'install_requires'}")


def requirement_of(wheel: Path, name: str) -> Optional[str]:
    """The specifier ``wheel`` requires of ``name`` (its unconditional ``Requires-Dist``), or
    None when it does not require it."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    for req in msg.get_all("Requires-Dist") or []:
        spec, _, marker = req.partition(";")
        if _norm(_name(spec)) == _norm(name) and "extra ==" not in marker:
            return spec.strip()[len(_name(spec)):].strip().strip("()")
    return None


def oldest(spec: str) -> str:
    """``spec`` narrowed to its lower bound (``">=1.31.0,<3.0"``: ``"==1.31.0"``), else as it
    is: the oldest release transformers accepts asks least of what the GPU machine already has
    (the newest huggingface_hub needs packages that are not there).

    >>> oldest(">=1.31.0,<3.0"), oldest("<0.24.0,>=0.23.1"), oldest("")
    ('==1.31.0', '==0.23.1', '')
    """
    lower = [part.strip()[2:] for part in spec.split(",") if part.strip().startswith(">=")]
    return f"=={lower[0]}" if lower else spec


def download(requirement: str, dest: Path, python_version: str) -> Path:
    """``pip download`` one wheel (no dependencies) for CPython ``python_version`` on x86-64
    Linux; return its path."""
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp",
           *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), requirement]
    print("gpu-wheels:", requirement, flush=True)
    subprocess.run(cmd, check=True)
    name = _norm(_name(requirement)).replace("-", "_")
    found = [w for w in dest.glob("*.whl") if _norm(w.name.split("-")[0]).replace("-", "_")
             == name]
    fresh = [w for w in found if w not in before] or found
    if not fresh:
        raise RuntimeError(f"gpu-wheels: pip downloaded no wheel for {requirement}")
    return max(fresh, key=lambda w: w.stat().st_mtime)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=ROOT / ".whl")
    ap.add_argument("--python-version", default="3.12")
    args = ap.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    got = []
    pydot = download("pydot" + pinned("", "pydot"), args.dest, args.python_version)
    got.append(pydot)
    pyparsing = requirement_of(pydot, "pyparsing")
    if pyparsing is not None:
        got.append(download("pyparsing" + pyparsing, args.dest, args.python_version))
    hf = download("transformers" + pinned("hf", "transformers"), args.dest,
                  args.python_version)
    got.append(hf)
    for dep in ("tokenizers", "huggingface_hub"):
        spec = requirement_of(hf, dep)
        got.append(download(dep + oldest(spec or ""), args.dest, args.python_version))
    names = {_norm(w.name.split("-")[0]) for w in got}
    stale = sorted(w.name for w in args.dest.glob("*.whl")
                   if w not in got and _norm(w.name.split("-")[0]) in names)
    print("gpu-wheels: " + ", ".join(w.name for w in got), flush=True)
    if stale:
        print(f"gpu-wheels: other versions of the same packages are in {args.dest} and would "
              f"be installed too; remove them: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
