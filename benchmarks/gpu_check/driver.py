"""The ``make gpu-check`` driver: every check in a subprocess of its own with a time limit.

Each check (``benchmarks.gpu_check.CHECKS``) runs as ``python -m benchmarks.gpu_check.child``
in a session of its own, with ``cwd`` the output folder (scratch files land there) and
``PYTHONPATH`` the wheels folder (``--site``, first), a temporary folder in which ``tidal`` is a
link to this repository (no install needed) and the repository root (``examples``,
``benchmarks``), and ``TIDAL_GPU_CHECK_DEADLINE`` its deadline (seconds since the epoch: a
check that runs a subprocess of its own stops it before). At its time limit the whole session
is killed (the check's own subprocesses too) and the check is recorded as failed with the last
lines it printed; the next check runs.
No check gets more than what is left of ``--total-s``; ``--jobs N`` runs N checks at once on
the CPU (never on a GPU, whose timings need the device). One JSON line per check goes to
``OUT/checks.jsonl`` as it ends, the table to ``OUT/table.md`` (rewritten after each check),
each check's output to ``OUT/logs/NAME.log``. Exit status 1 if any check failed.

    python -m benchmarks.gpu_check --device cuda --out gpu-check-out [--site /tmp/site]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

from benchmarks.gpu_check import CHECKS, QUICK_S, TOTAL_S
from benchmarks.gpu_check.table import render, summary

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def import_path(site: Optional[Path] = None) -> Iterator[list[str]]:
    """The ``PYTHONPATH`` entries of a check: ``site`` (wheels installed with ``--target``,
    first, so they shadow the machine's versions), a temporary folder holding the link
    ``tidal -> <repository root>``, and the repository root. The folder is removed after."""
    folder = Path(tempfile.mkdtemp(prefix="tidal-gpu-check-"))
    link = folder / "tidal"
    link.symlink_to(ROOT, target_is_directory=True)
    try:
        yield ([str(site)] if site is not None else []) + [str(folder), str(ROOT)]
    finally:
        link.unlink()
        folder.rmdir()


def child_env(entries: Sequence[str]) -> dict[str, str]:
    """This process's environment with ``entries`` first on ``PYTHONPATH``, unbuffered output
    and Hugging Face kept offline."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*entries, *filter(None, [env.get("PYTHONPATH")])])
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def _kill_session(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def run_check(name: str, device: str, quick: bool, limit_s: float, out: Path,
              env: dict[str, str]) -> dict:
    """Run check ``name`` in a subprocess (its own session) for at most ``limit_s`` seconds;
    return its record with ``seconds``, ``limit_s`` and ``timed_out`` added."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result, log = logs / f"{name}.json", logs / f"{name}.log"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.gpu_check.child", name, "--device", device,
           "--result", str(result)] + (["--quick"] if quick else [])
    t0 = time.monotonic()
    timed_out = False
    env = dict(env, TIDAL_GPU_CHECK_DEADLINE=f"{time.time() + limit_s:.1f}")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(limit_s, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_session(proc)
            rc = proc.wait()
        finally:
            _kill_session(proc)  # what the check left running (spawned workers, pytest)
    seconds = time.monotonic() - t0
    if timed_out:
        rec = {"name": name, "ok": False, "figures": {}, "summary": [],
               "error": f"time limit of {limit_s:.0f} s reached; last output: {_tail(log)}"}
    elif result.exists():
        rec = json.loads(result.read_text())
    else:
        rec = {"name": name, "ok": False, "figures": {}, "summary": [],
               "error": f"exit status {rc} and no result; last output: {_tail(log)}"}
    rec.update(seconds=round(seconds, 2), limit_s=round(limit_s, 1), timed_out=timed_out,
               device=device, quick=quick)
    return rec


def _selected(only: Optional[str]) -> list[tuple[str, float]]:
    if not only:
        return list(CHECKS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = dict(CHECKS)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"gpu-check: unknown check(s) {unknown}; known: {list(known)}")
    return [(n, known[n]) for n in names]


def _not_run(name: str, device: str, quick: bool) -> dict:
    return {"name": name, "ok": False, "figures": {}, "summary": [],
            "error": "not run: the total time budget was spent", "seconds": 0.0,
            "limit_s": 0.0, "timed_out": False, "device": device, "quick": quick}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--out", default="gpu-check-out", type=Path)
    ap.add_argument("--quick", action=argparse.BooleanOptionalAction, default=None,
                    help="tiny sizes (default: on the CPU)")
    ap.add_argument("--site", type=Path, default=None,
                    help="folder of installed wheels, put first on the path")
    ap.add_argument("--only", default=None, help="comma-separated check names")
    ap.add_argument("--total-s", type=float, default=TOTAL_S)
    ap.add_argument("--limit-s", type=float, default=None,
                    help="the time limit of every check (default: each check's own)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="checks run at once, on the CPU only (a GPU's timings need the "
                         "device to themselves)")
    args = ap.parse_args(argv)
    if args.jobs < 1 or (args.jobs > 1 and args.device != "cpu"):
        raise SystemExit(f"gpu-check: --jobs {args.jobs}: one check at a time on "
                         f"{args.device}; more only with --device cpu")
    quick = args.device == "cpu" if args.quick is None else args.quick
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    jsonl, table = out / "checks.jsonl", out / "table.md"
    jsonl.write_text("")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    checks = _selected(args.only)
    order = {name: i for i, (name, _) in enumerate(checks)}
    deadline = time.monotonic() + args.total_s
    records: list[dict] = []
    lock = threading.Lock()
    print(f"gpu-check: {len(checks)} checks on {args.device}"
          f"{' (quick: tiny sizes)' if quick else ''}, at most {args.total_s:.0f} s; "
          f"output in {out}", flush=True)

    def one(i: int, name: str, limit: float, env: dict[str, str]) -> None:
        tag = f"[{i}/{len(checks)}] {name}"
        left = deadline - time.monotonic()
        limit = min(args.limit_s or (QUICK_S if quick else limit), left)
        if left < 5.0:
            rec = _not_run(name, args.device, quick)
        else:
            print(f"{tag}: running (limit {limit:.0f} s)", flush=True)
            rec = run_check(name, args.device, quick, limit, out, env)
        state = "ok" if rec["ok"] else f"FAILED ({rec['error']})"
        with lock:
            records.append(rec)
            records.sort(key=lambda r: order[r["name"]])
            with open(jsonl, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
            table.write_text(render(records, date=date, device=args.device, quick=quick) + "\n")
            print(f"{tag}: {state} in {rec['seconds']:.1f} s; {summary(rec)}", flush=True)

    with import_path(args.site) as entries:
        env = child_env(entries)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            for done in [pool.submit(one, i, name, limit, env)
                         for i, (name, limit) in enumerate(checks, 1)]:
                done.result()
    print("\n" + table.read_text(), flush=True)
    failed = [r["name"] for r in records if not r["ok"]]
    print(f"gpu-check: {len(records) - len(failed)}/{len(records)} checks ok"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"; {jsonl}", flush=True)
    return 1 if failed else 0
