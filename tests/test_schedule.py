"""Schedules as data: labels, checks that catch bad schedules, JSON round trip, Gantt, batch
splitting."""
import pytest
import torch

from tidal.ir.errors import PlanError
from tidal.ir.plan import Plan
from tidal.ir.schedule import Action, Schedule, split_batch


def _two_rank(f1_start=1.0, b_rank=1):
    r0 = (Action("F", 0, 0, start_us=0, dur_us=1), Action("B", 0, 0, start_us=3, dur_us=1))
    r1 = (Action("F", 0, 1, start_us=f1_start, dur_us=1),
          Action("B", 0, 1, start_us=2, dur_us=1))
    ranks = (r0, r1) if b_rank == 1 else (r0 + (r1[1],), (r1[0],))
    return Schedule(name="pipe", ranks=ranks, partitions=2, batches=1)


def test_labels_and_table():
    assert Action("F", 1, wave="T").label(False) == "T:F1"
    assert Action("B", 3, 2).label(True) == "B2,3"
    assert Action("S", partition=2).label(True) == "S2"
    s = _two_rank()
    s.check()
    assert s.table().splitlines()[1:3] == ["rank 0: F0,0 B0,0", "rank 1: F1,0 B1,0"]
    assert s.makespan_us == 4.0
    assert Plan.from_json(s.to_json()) == s
    with pytest.raises(PlanError, match="kind"):
        Action("Q")


def test_checks_catch_overlap_duplicates_missing_and_order():
    with pytest.raises(PlanError, match="starts at 0.5 us before F0,0"):
        _two_rank(f1_start=0.5).check_dependencies()
    bad = Schedule(name="x", ranks=((Action("F", 0, start_us=0, dur_us=2),
                                     Action("B", 0, start_us=1, dur_us=1)),))
    with pytest.raises(PlanError, match="rank 0 lane '' runs B0 at 1 us while F0"):
        bad.check_no_overlap()
    lanes = Schedule(name="x", ranks=((Action("F", 0, lane="a", start_us=0, dur_us=2),
                                       Action("B", 1, lane="b", start_us=1, dur_us=1)),))
    lanes.check_no_overlap()  # different lanes may overlap
    with pytest.raises(PlanError, match="misses"):
        Schedule(name="x", ranks=((Action("F", 0), Action("B", 0)),), batches=2).check_coverage()
    dup = Schedule(name="x", ranks=((Action("F", 0), Action("B", 0)),
                                    (Action("F", 0), Action("B", 0))))
    with pytest.raises(PlanError, match="runs twice"):
        dup.check_coverage()
    Schedule(name="dp", ranks=dup.ranks, data_parallel=True).check_coverage()
    with pytest.raises(PlanError, match="no rank 5"):
        dup.for_rank(5)


def test_gantt_svg_draws_every_action():
    svg = _two_rank().gantt_svg()
    assert svg.startswith("<svg") and svg.count("<rect") == 4
    assert "F1,0" in svg and "rank 1" in svg


def test_split_batch():
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    parts = split_batch(((x,), y, "keep"), 3)
    assert [p[1].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert torch.equal(parts[2][0][0], x[4:]) and parts[0][2] == "keep"
    with pytest.raises(ValueError, match="batch size 6 is not divisible by 4"):
        split_batch(x, 4)
    with pytest.raises(ValueError, match="disagree"):
        split_batch((x, torch.arange(5)), 1)


def test_a_schedule_lowers_to_one_placed_program():
    # tick-tock on 2 ranks: every action a piece of its kind, each all-reduce one collective
    # piece on both ranks, on the comm stream, after what each rank finished before it
    from tidal.ir.schedule import schedule_program
    from tidal.passes.tick_tock import tick_tock_schedule

    s = tick_tock_schedule(2, 10.0, 20.0, 5.0, steps=2)
    p = schedule_program(s)
    actions = [a for acts in s.ranks for a in acts]
    reduces = sum(a.kind == "A" for a in actions)
    assert len(p.pieces) == len(actions) - reduces // 2
    collectives = [q for q in p.pieces if q.kind == "collective"]
    assert len(collectives) == reduces // 2
    assert all(q.ranks == (0, 1) and q.stream == "comm" for q in collectives)
    assert all(len(q.ranks) == 1 and q.stream == "compute" for q in p.pieces
               if q.kind in ("segment", "optimizer"))
    for q in collectives:  # its wave's backward of that batch ended on both ranks first
        waited = [p.pieces[d] for d in q.deps]
        assert {w.ranks[0] for w in waited if w.name == q.name.replace("A", "B")} == {0, 1}
    assert p.world == 2
