"""One check in this process: ``python -m benchmarks.gpu_check.child NAME --device D
[--quick] --result FILE`` imports ``benchmarks.gpu_check.NAME``, calls its ``run(device,
quick)`` and writes the check's record (name, ok, figures, error, summary keys) to FILE as
JSON. The driver starts it in a session of its own and kills the session at its time limit."""
from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Optional


def record(name: str, figures: dict, error: Optional[str], summary: tuple = ()) -> dict:
    """A check's record: failed when it raised (``error``) or listed ``failures``."""
    failures = list(figures.get("failures") or [])
    problems = ([error] if error else []) + failures
    return {"name": name, "ok": not problems, "figures": figures,
            "error": "; ".join(problems) or None, "summary": list(summary)}


def run_check(name: str, device: str, quick: bool) -> dict:
    """Import the check module ``name`` and run it; an exception becomes the record's error
    (its type, message and the last frames)."""
    try:
        module = importlib.import_module(f"benchmarks.gpu_check.{name}")
    except Exception as e:  # noqa: BLE001 - recorded, never hidden
        return record(name, {}, f"cannot import the check: {type(e).__name__}: {e}")
    summary = tuple(getattr(module, "SUMMARY", ()))
    try:
        figures = module.run(device, quick)
    except Exception as e:  # noqa: BLE001
        frames = traceback.format_exception(type(e), e, e.__traceback__)
        print("".join(frames), file=sys.stderr, flush=True)
        where = "".join(traceback.format_tb(e.__traceback__)[-2:]).strip().replace("\n", " | ")
        return record(name, {}, f"{type(e).__name__}: {e} [at {where}]", summary)
    return record(name, dict(figures), None, summary)


def dump_stacks_before_deadline(margin_s: float = 3.0) -> None:
    """Print every thread's stack ``margin_s`` before ``TIDAL_GPU_CHECK_DEADLINE`` (the
    driver kills the check there): a check that hangs shows where in its log."""
    deadline = os.environ.get("TIDAL_GPU_CHECK_DEADLINE")
    if deadline:
        faulthandler.dump_traceback_later(max(float(deadline) - time.time() - margin_s, 1.0),
                                          exit=False, file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--result", required=True, type=Path)
    args = ap.parse_args(argv)
    dump_stacks_before_deadline()
    rec = run_check(args.name, args.device, args.quick)
    args.result.write_text(json.dumps(rec, default=str))
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
