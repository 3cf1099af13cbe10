"""``tidal inspect MODEL --passes embedding_cache --bagpipe N``: train N iterations with Bagpipe
(dissertation ch. 5) on synthetic click data and show its per-iteration statistics: cache hit
rate, rows prefetched, rows synced on and off the critical path, rows written back, bytes moved
and bytes on the critical path, as a table, in ``--json`` and as a section of the dump index.

This module does not import torch at import time (``tidal --help`` builds its parser from it).
The click data come from the in-repo ``examples.data.clicks``, imported by name when a run
starts, the way the CLI finds the in-repo zoo (``tidal.compiler.model_spec``).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from tidal.compiler.cli_args import (UsageError, non_negative_int, positive_float,
                                     positive_int)

PASS = "embedding_cache"
CLICK_DATA_MODULE = "examples.data.clicks"
SECTION = "Bagpipe per iteration"
DEFAULT_TRAINERS = 2
DEFAULT_ALPHA = 1.0
SERVERS = 1
HEADERS = ("iteration", "hit rate", "prefetched", "synced critical", "synced background",
           "written back", "KiB moved", "KiB critical", "ms")


def add_bagpipe_args(p: argparse.ArgumentParser) -> None:
    """``--bagpipe N``, ``--trainers``, ``--lookahead`` and ``--zipf-alpha``."""
    g = p.add_argument_group(
        "Bagpipe training", "needs --passes embedding_cache and a recommendation model with "
        "num_dense and table_rows attributes (dlrm_small, deepfm_small, dlrm, deepfm)")
    g.add_argument("--bagpipe", type=positive_int, default=None, metavar="N",
                   help="after the report, train N iterations with Bagpipe (trainer processes + "
                        f"{SERVERS} embedding server + the Oracle Cacher, on this machine) on "
                        "synthetic click data of --batch samples and print per iteration the "
                        "cache hit rate, rows prefetched, rows synced on and off the critical "
                        "path, rows written back and KiB moved (default: no run)")
    g.add_argument("--trainers", type=positive_int, default=None, metavar="T",
                   help=f"--bagpipe: trainer processes; --batch must be a multiple of it "
                        f"(default {DEFAULT_TRAINERS})")
    g.add_argument("--lookahead", type=non_negative_int, default=None, metavar="L",
                   help="embedding_cache: batches the Oracle Cacher looks ahead to prefetch "
                        "and to cache (default: the pass's, 1; same as -o lookahead=L)")
    g.add_argument("--zipf-alpha", type=positive_float, default=None, metavar="A",
                   help="--bagpipe: Zipf skew of the synthetic ids; larger means fewer hot rows "
                        f"and more cache hits (default {DEFAULT_ALPHA})")


def _pass_names(passes: str) -> list[str]:
    return [n.strip() for n in (passes or "").split(",") if n.strip()]


def check_bagpipe_args(args: argparse.Namespace) -> None:
    """The fast checks, before anything compiles: a ``UsageError`` naming the option."""
    has_pass = PASS in _pass_names(args.passes)
    if args.bagpipe is None:
        for flag, value in (("--trainers", args.trainers), ("--zipf-alpha", args.zipf_alpha)):
            if value is not None:
                raise UsageError(f"{flag} only applies to a Bagpipe run: add --bagpipe N")
    elif not has_pass:
        raise UsageError(f"--bagpipe needs the {PASS} pass: add --passes {PASS} (it rewrites "
                         f"the embedding lookups Bagpipe caches; --passes auto does not select "
                         f"it)")
    if args.lookahead is not None and not has_pass:
        raise UsageError(f"--lookahead is the {PASS} pass's lookahead: add --passes {PASS}")
    trainers = args.trainers or DEFAULT_TRAINERS
    if args.bagpipe is not None and args.batch % trainers:
        raise UsageError(f"--bagpipe: --batch {args.batch} is not a multiple of {trainers} "
                         f"trainers (each trainer takes an equal share of a batch)")


def click_data(args: argparse.Namespace, model: Any) -> Any:
    """``ClickData`` for ``model`` (its ``num_dense`` and ``table_rows``) at ``--batch`` and
    ``--zipf-alpha``; a ``UsageError`` for a model without them."""
    num_dense = getattr(model, "num_dense", None)
    table_rows = getattr(model, "table_rows", None)
    if not isinstance(num_dense, int) or not table_rows:
        raise UsageError(f"--bagpipe needs a recommendation model with num_dense and "
                         f"table_rows attributes (such as dlrm_small or deepfm_small) to "
                         f"generate click data for; MODEL {args.model!r} has "
                         f"{'neither' if num_dense is None and not table_rows else 'not both'}")
    from tidal.compiler.model_spec import cwd_importable

    cwd_importable()
    try:
        module = importlib.import_module(CLICK_DATA_MODULE)
    except ImportError as e:
        raise UsageError(f"--bagpipe: cannot import {CLICK_DATA_MODULE} for the synthetic "
                         f"click data ({e}); run from a checkout of the repository") from None
    alpha = DEFAULT_ALPHA if args.zipf_alpha is None else args.zipf_alpha
    return module.ClickData(num_dense, tuple(int(r) for r in table_rows), args.batch,
                            alpha=alpha)


def prepare(args: argparse.Namespace, compiled: Any) -> Any:
    """The click data for a ``--bagpipe`` run of ``compiled``, checked before anything is
    printed: a ``UsageError`` when the model is no recommendation model or the pass cached no
    table."""
    data = click_data(args, compiled.model)
    plan = compiled.plan.get(PASS)
    if plan is None or not plan.tables:
        raise UsageError(f"--bagpipe: the {PASS} pass cached no embedding table of MODEL "
                         f"{args.model!r} (its notes in 'tidal inspect' say why)")
    return data


def run_bagpipe(args: argparse.Namespace, compiled: Any, data: Any) -> dict:
    """Train ``--bagpipe`` iterations of ``compiled`` on ``data`` (from :func:`prepare`) with
    Bagpipe; the run's settings and its per-iteration stats (``IterationStats`` summed over
    trainers) as a dict."""
    plan = compiled.plan.get(PASS)
    trainers = args.trainers or DEFAULT_TRAINERS
    alpha = DEFAULT_ALPHA if args.zipf_alpha is None else args.zipf_alpha
    run = {"iterations": args.bagpipe, "trainers": trainers, "servers": SERVERS,
           "lookahead": plan.lookahead, "zipf_alpha": alpha, "batch": args.batch}
    print(f"tidal: training {args.bagpipe} iterations with Bagpipe on {trainers} trainers + "
          f"{SERVERS} embedding server (lookahead {plan.lookahead}, Zipf alpha {alpha}, "
          f"batch {args.batch}) ...", file=sys.stderr, flush=True)
    options: dict[str, Any] = {"trainers": trainers, "servers": SERVERS}
    if getattr(args, "lr", None) is not None:
        options["lr"] = args.lr
    result = compiled.bagpipe(data, args.bagpipe, **options)
    run["stats"] = list(result.stats)
    return run


def stats_json(run: dict) -> dict:
    """``run`` with each iteration's stats as a dict (``hit_rate`` and ``bytes_moved`` too)."""
    rows = [{**asdict(s), "hit_rate": s.hit_rate, "bytes_moved": s.bytes_moved}
            for s in run["stats"]]
    return {**{k: v for k, v in run.items() if k != "stats"}, "stats": rows,
            "total": _totals(run["stats"])}


def _kib(n: int) -> float:
    return round(n / 1024, 1)


def _totals(stats: Sequence[Any]) -> dict:
    total = {k: sum(getattr(s, k) for s in stats)
             for k in ("lookups", "hits", "rows_fetched", "rows_synced_critical",
                       "rows_synced_background", "rows_written", "bytes_critical")}
    total["bytes_moved"] = sum(s.bytes_moved for s in stats)
    total["seconds"] = sum(s.seconds for s in stats)
    total["hit_rate"] = total["hits"] / total["lookups"] if total["lookups"] else 1.0
    return total


def stats_table(run: dict) -> str:
    """The per-iteration table and a totals line."""
    from tidal.ir.table import format_table

    stats = run["stats"]
    rows = [[s.iteration, round(s.hit_rate, 3), s.rows_fetched, s.rows_synced_critical,
             s.rows_synced_background, s.rows_written, _kib(s.bytes_moved),
             _kib(s.bytes_critical), round(s.seconds * 1e3, 1)] for s in stats]
    t = _totals(stats)
    total = (f"total: {len(stats)} iterations, hit rate {t['hit_rate']:.3f} ({t['hits']} of "
             f"{t['lookups']} lookups), {t['rows_fetched']} rows prefetched, "
             f"{t['rows_synced_critical']} synced on the critical path and "
             f"{t['rows_synced_background']} off it, {t['rows_written']} written back, "
             f"{_kib(t['bytes_moved'])} KiB moved ({_kib(t['bytes_critical'])} KiB on the "
             f"critical path), {t['seconds'] * 1e3:.1f} ms")
    return format_table(HEADERS, rows) + "\n" + total


def title(run: dict) -> str:
    """One line naming the run's settings."""
    return (f"Bagpipe: {run['iterations']} iterations, {run['trainers']} trainers + "
            f"{run['servers']} embedding server, lookahead {run['lookahead']}, synthetic "
            f"clicks (Zipf alpha {run['zipf_alpha']}, batch {run['batch']}); stats summed "
            f"over trainers (ms: the slowest)")


def bagpipe_section(out_dir: Path, run: dict):
    """Write ``bagpipe.txt`` into ``out_dir`` and return the dump index's section."""
    from tidal.compiler import viz

    text = stats_table(run)
    out_dir.mkdir(parents=True, exist_ok=True)
    txt = out_dir / "bagpipe.txt"
    txt.write_text(title(run) + "\n" + text + "\n")
    t = _totals(run["stats"])
    rows = (("kind", "measured: a Bagpipe training run on this machine (CPU processes)"),
            ("processes", f"{run['trainers']} trainers + {run['servers']} embedding server + "
                          f"the Oracle Cacher"),
            ("iterations", str(run["iterations"])),
            ("lookahead", str(run["lookahead"])),
            ("data", f"synthetic clicks, Zipf alpha {run['zipf_alpha']}, batch {run['batch']}"),
            ("hit rate", f"{t['hit_rate']:.3f} ({t['hits']} of {t['lookups']} lookups)"),
            ("bytes moved", f"{_kib(t['bytes_moved'])} KiB ({_kib(t['bytes_critical'])} KiB on "
                            f"the critical path)"))
    return viz.DumpSection(name=SECTION, summary_rows=rows, files=(Path(txt.name),), text=text)


