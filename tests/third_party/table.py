"""Print the README's "Models tested" table from the actual results of the third-party matrix.

    .venv/bin/python -m tests.third_party.table          # about 1.5 minutes on 2 cores

Each cell: ``equal`` (the equivalence check passed), ``refused: <error>`` (a clear tidal error),
``unchanged (...)`` (the pass found nothing to do and said so), or ``BUG: ...`` (wrong result or a
raw error). The multi-rank columns run on 2 gloo ranks, one spawned job per model.
"""
from __future__ import annotations

import re
import sys
import warnings

import torch

from tidal.ir.errors import TidalError
from tidal.ir.export_capture import ExportCache, reusing_exports
from tidal.runtime.distributed import spawn

from .matrix import MULTI_RANK, PASSES, Refuse, check_recompile, check_single, expected, run_ranks
from .models import BUILDERS

LOSS_TOL = PARAM_TOL = 1e-5


def _short(message: str) -> str:
    message = re.sub(r"^pass '\w+': (\w+: )?", "", message.splitlines()[0])
    return message[:110].replace("|", "\\|")


def _refused(model_name: str, cell: str, message: str, ranks: bool = False) -> str:
    """The recorded short reason when the error is the expected one, else the message."""
    want = expected(model_name, cell, ranks=ranks)
    if isinstance(want, Refuse) and re.search(want.match, message):
        return f"refused: {want.reason}"
    return f"refused: {_short(message)}"


def single_cell(model_name: str, pass_name: str, exports: ExportCache) -> str:
    """The cell's entry; the recompile check exports (keeping its export in ``exports``), the
    others reuse what ``exports`` holds."""
    try:
        if pass_name == "recompile":
            c = check_recompile(model_name, exports)
        else:
            with reusing_exports(exports):
                c = check_single(model_name, pass_name)
    except TidalError as e:
        return _refused(model_name, pass_name, str(e))
    except AssertionError as e:
        return f"BUG: {_short(str(e))}"
    except Exception as e:  # noqa: BLE001 - a raw error is what the table reports
        return f"BUG: raw {type(e).__name__}: {_short(str(e))}"
    if pass_name == "clustered_attention" and c.plan.get("clustered_attention") is None:
        return "unchanged (no attention found)"
    return "equal"


def rank_cells(model_name: str) -> dict[str, str]:
    out = {}
    try:
        results = spawn(run_ranks, 2, model_name, timeout_s=300)
    except Exception as e:  # noqa: BLE001
        return dict.fromkeys(MULTI_RANK, f"BUG: {type(e).__name__}: {_short(str(e))}")
    for cell in MULTI_RANK:
        got = [r[cell] for r in results]
        if got[0][0] == "error":
            out[cell] = (_refused(model_name, cell, got[0][2], ranks=True)
                         if got[0][1] in ("PassError", "PlanError", "TraceError")
                         else f"BUG: raw {got[0][1]}: {_short(got[0][2])}")
            continue
        spread = max(float(abs(g[3] - got[0][3]).max()) for g in got)
        worst = max(max(g[1] for g in got), max(g[2] for g in got))
        out[cell] = "equal" if spread == 0 and worst <= max(LOSS_TOL, PARAM_TOL) else \
            f"BUG: error {worst:.1e}, rank spread {spread:.1e}"
    return out


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    models = (argv or sys.argv[1:]) or list(BUILDERS)
    single = [p for p in PASSES] + ["recompile"]
    rows = []
    exports = ExportCache()
    for m in models:
        first = {"recompile": single_cell(m, "recompile", exports)}   # it exports the model
        row = {p: first.get(p) or single_cell(m, p, exports) for p in single}
        row.update({f"2 ranks {c}": v for c, v in rank_cells(m).items()})
        rows.append((m, row))
        print(f"{m}: done", file=sys.stderr, flush=True)
    cols = list(rows[0][1])
    print("| model | " + " | ".join(cols) + " |")
    print("| --- " * (len(cols) + 1) + "|")
    for m, row in rows:
        print(f"| {m} | " + " | ".join(row[c] for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
