"""GPipe, 1F1B, tick-tock and round-robin schedules in one vocabulary: builders for any N, the
compact form and CSV round trips, and the deadlock checker (issue 19, item 4)."""
import json
from collections import Counter
from dataclasses import replace

import pytest

from tidal.ir.errors import PlanError
from tidal.ir.pipeline_schedules import (
    check_deadlock_free, format_action, format_schedule, from_actions, gpipe, one_f_one_b,
    parse_action, parse_schedule, peak_in_flight, round_robin, schedule_from_csv,
    schedule_to_csv, strip_timing, tick_tock, with_transfers)
from tidal.ir.plan import Plan
from tidal.ir.schedule import Action, Schedule
from tidal.passes.round_robin import round_robin_schedule
from tidal.passes.tick_tock import tick_tock_schedule

CASES = [(n, m) for n in range(1, 7) for m in sorted({1, n, 2 * n})]
PIPELINES = [gpipe, one_f_one_b]


def _all(n, m):
    """Every builder's schedule for N = n (M = m micro-batches, or steps for tick-tock)."""
    return [gpipe(n, m), one_f_one_b(n, m), gpipe(n, m, split_backward=True),
            one_f_one_b(n, m, split_backward=True), tick_tock(n, m), round_robin(n)]


@pytest.mark.parametrize("n,m", CASES)
def test_builders_are_deadlock_free_and_pass_the_schedule_checks(n, m):
    for s in _all(n, m):
        check_deadlock_free(s)
        s.check()
        assert len(s.ranks) == n


@pytest.mark.parametrize("n,m", CASES)
@pytest.mark.parametrize("build", PIPELINES)
@pytest.mark.parametrize("split", [False, True])
def test_every_forward_and_backward_runs_once_on_its_stage(build, split, n, m):
    s = build(n, m, split_backward=split)
    kinds = ("F", "B", "W") if split else ("F", "B")
    got = Counter((a.kind, a.partition, a.batch) for acts in s.ranks for a in acts
                  if a.kind in kinds)
    assert got == Counter({(k, p, b): 1 for k in kinds for p in range(n) for b in range(m)})
    for r, acts in enumerate(s.ranks):  # stage r on rank r, one update per stage at the end
        assert {a.partition for a in acts if a.kind in kinds} == {r}
        assert acts[-1] == replace(acts[-1], kind="U", partition=r, batch=0)
        assert not any(a.kind in ("A", "X") for a in acts)
    sends = Counter((r, a.peer, a.moves, a.batch) for r, acts in enumerate(s.ranks)
                    for a in acts if a.kind == "SEND")
    recvs = Counter((a.peer, r, a.moves, a.batch) for r, acts in enumerate(s.ranks)
                    for a in acts if a.kind == "RECV")
    want = Counter({(r, r + 1, "F", b): 1 for r in range(n - 1) for b in range(m)}
                   | {(r, r - 1, "B", b): 1 for r in range(1, n) for b in range(m)})
    assert sends == recvs == want


@pytest.mark.parametrize("n", range(1, 7))
def test_round_robin_is_figure_10_in_the_shared_vocabulary(n):
    s = round_robin(n)
    assert (s.partitions, s.batches) == (n, n)
    for i, acts in enumerate(s.ranks):
        compute = [(a.kind, a.partition, a.batch) for a in acts if a.kind in ("F", "B")]
        assert compute == [("F", c, (i - c) % n) for c in range(n)] + \
            [("B", p, (i - p) % n) for p in reversed(range(n))]
        for k, a in enumerate(acts):  # a switch S right before every partition's forward
            if a.kind == "F":
                assert acts[k - 1] == Action("S", partition=a.partition, start_us=a.start_us)
            if a.kind == "SEND":
                assert a.peer == ((i + 1) % n if a.moves == "F" else (i - 1) % n)
        assert [a.partition for a in acts if a.kind == "U"] == list(range(n))
    if n > 1:  # the pass's own schedule (with ring transfers X) in the same order, and checked
        old = round_robin_schedule([1.0] * n, [2.0] * n, [0.5] * n, [0.1] * n, [0.2] * n)
        check_deadlock_free(old)
        keep = ("S", "F", "B", "A")
        for mine, theirs in zip(s.ranks, old.ranks):
            assert [(a.kind, a.partition, a.batch) for a in mine if a.kind in keep] == \
                [(a.kind, a.partition, a.batch) for a in theirs if a.kind in keep]


@pytest.mark.parametrize("n,steps", CASES)
def test_tick_tock_is_the_pass_schedule(n, steps):
    s = tick_tock(n, steps)
    assert s == tick_tock_schedule(n, 1.0, 2.0, 0.0, steps)
    assert tick_tock(n, steps, fwd_us=3.0, bwd_us=5.0, allreduce_us=1.0) == \
        tick_tock_schedule(n, 3.0, 5.0, 1.0, steps)
    assert {a.wave for a in s.ranks[0]} == {"T", "K"}
    assert Counter(a.kind for a in s.ranks[0]) == Counter({k: 2 * steps for k in "FBAU"})


@pytest.mark.parametrize("n,m", CASES)
def test_one_f_one_b_bounds_activations_gpipe_keeps_all(n, m):
    f1b, gp = one_f_one_b(n, m), gpipe(n, m)
    for r in range(n):
        assert peak_in_flight(f1b, r) == min(n - r, m) <= n - r
        assert peak_in_flight(gp, r) == m
    # both have the classic bubble (N-1)/(M+N-1) with F:B = 1:2
    for s in (f1b, gp):
        assert s.note("bubble_fraction") == pytest.approx((n - 1) / (m + n - 1))


def test_compact_tokens_round_trip_for_every_kind():
    acts = [Action("F", 0, 1), Action("B", 3, 0), Action("W", 1, 2), Action("S", partition=1),
            Action("A", partition=0), Action("U", partition=0), Action("X", 2, 1),
            Action("SEND", 0, 1, peer=2, moves="F"), Action("RECV", 1, 2, peer=3, moves="B"),
            Action("SEND", 4, 0, moves="B"), Action("RECV", 0, 1, moves="F"),
            Action("A", 2, wave="T", lane="T"), Action("F", 5, wave="K", lane="K"),
            Action("A", partition=2, lane="comm"), Action("U", 3, wave="K", lane="")]
    texts = [format_action(a) for a in acts]
    assert texts == ["1F0", "0B3", "2W1", "1S", "0A", "0U", "1X2", "1SEND_F0>2", "2RECV_B1<3",
                     "0SEND_B4", "1RECV_F0", "T:0A2", "K:0F5", "2A@comm", "K:0U3@"]
    assert [parse_action(t) for t in texts] == acts
    timed = Action("F", 1, 2, start_us=3.0, dur_us=4.0)
    assert parse_action(format_action(timed)) == replace(timed, start_us=0.0, dur_us=0.0)
    assert parse_action(" 0A0 ") == Action("A")


@pytest.mark.parametrize("token", ["", "F0", "1Q0", "1F", "1SEND0", "1SEND_F0<2",
                                   "1RECV_B0>2", "1F0>2", "1F0x", "-1F0", "1SEND_X0"])
def test_bad_tokens_are_named(token):
    with pytest.raises(ValueError, match=f"bad action token {token!r}"):
        parse_action(token)


def test_bad_lines_and_csv_cells_are_named(tmp_path):
    with pytest.raises(ValueError, match="expected 'rank 1: <actions>'"):
        parse_schedule("rank 0: 0F0\nrank 2: 1F0")
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1Z0\n")
    with pytest.raises(ValueError, match="row 2 column 2: bad action token '1Z0'"):
        schedule_from_csv(path)


@pytest.mark.parametrize("n,m", [(1, 1), (2, 4), (3, 3), (4, 8), (6, 12)])
def test_text_and_csv_round_trip(tmp_path, n, m):
    for s in _all(n, m):
        bare = strip_timing(s)
        text = format_schedule(s)
        assert len(text.splitlines()) == n
        assert parse_schedule(text, s.name, s.data_parallel) == bare
        path = tmp_path / f"{s.name}.csv"
        schedule_to_csv(s, path)
        assert schedule_from_csv(path, data_parallel=s.data_parallel) == bare
        rows = path.read_text().splitlines()
        assert rows[0].split(",") == [format_action(a) for a in s.ranks[0]]
        if n > 1:  # inferred: a forward on two ranks means data-parallel
            assert schedule_from_csv(path) == bare
        check_deadlock_free(schedule_from_csv(path, data_parallel=s.data_parallel))


def test_schedule_json_round_trip_is_exact_with_the_new_fields():
    for s in _all(3, 3):
        assert Plan.from_json(s.to_json()) == s
        assert Schedule.from_json(s.to_json()) == s
    old = json.loads(tick_tock(1).to_json())  # a plan written before peer/moves existed
    for a in old["data"]["ranks"][0]:
        del a["peer"], a["moves"]
    assert Plan.from_json(json.dumps(old)) == tick_tock(1)


def test_action_validates_peer_and_moves():
    with pytest.raises(PlanError, match="moves=''"):
        Action("SEND", 0, 0, peer=1)
    with pytest.raises(PlanError, match="only SEND/RECV name a peer"):
        Action("F", 0, 0, peer=1)
    with pytest.raises(PlanError, match="only SEND/RECV"):
        Action("X", 0, 0, moves="F")
    with pytest.raises(PlanError, match="peer=-2"):
        Action("RECV", 0, 1, peer=-2, moves="F")
    assert Action("SEND", 1, 2, peer=3, moves="F").label(True) == "SEND_F2,1>3"
    assert Action("W", 1, 2).label(False) == "W1"


def _swap_first(s, rank, first, second):
    """``s`` with rank ``rank``'s first adjacent (``first``, ``second``) pair of transfers with
    the same peer swapped."""
    acts = list(s.ranks[rank])
    for k, (a, b) in enumerate(zip(acts, acts[1:])):
        if (a.kind, b.kind) == (first, second) and a.peer == b.peer:
            acts[k], acts[k + 1] = b, a
            ranks = list(s.ranks)
            ranks[rank] = tuple(acts)
            return replace(s, ranks=tuple(ranks)), a, b
    raise AssertionError(f"rank {rank} has no adjacent {first}, {second} with one peer")


def test_swapped_send_recv_pair_is_the_classic_deadlock():
    s = one_f_one_b(2, 4)
    # rank 0 sends F2 then receives B1; rank 1 must receive F2 before it sends B1
    bad, recv, send = _swap_first(s, 1, "RECV", "SEND")
    assert (format_action(recv), format_action(send)) == ("1RECV_F2<0", "1SEND_B1>0")
    with pytest.raises(PlanError) as e:
        check_deadlock_free(bad)
    msg = str(e.value)
    assert "schedule '1f1b' deadlocks" in msg
    assert "rank 0 waits at action 7 (0SEND_F2>1): blocking send to rank 1, which waits at " \
        "action 7 (1SEND_B1>0)" in msg
    assert "rank 1 waits at action 7 (1SEND_B1>0): blocking send to rank 0, which waits at " \
        "action 7 (0SEND_F2>1)" in msg


@pytest.mark.parametrize("build", PIPELINES)
@pytest.mark.parametrize("n", range(2, 7))
def test_swapped_pairs_deadlock_for_any_n(build, n):
    s = build(n, 2 * n)
    for rank, first, second in [(n - 2, "SEND", "RECV"), (n - 1, "RECV", "SEND")]:
        if build is gpipe and first == "RECV":
            continue  # GPipe's last rank never receives right before it sends back
        bad, a, b = _swap_first(s, rank, first, second)
        with pytest.raises(PlanError, match="deadlocks") as e:
            check_deadlock_free(bad)
        stuck = {r for r in range(n) if f"rank {r} waits at" in str(e.value)}
        assert {rank, a.peer} <= stuck


def test_unmatched_transfers_are_rejected():
    s = gpipe(3, 2)
    ranks = [list(acts) for acts in s.ranks]
    dropped = ranks[2].pop(0)  # rank 2's first receive: rank 1's send has no match
    assert format_action(dropped) == "2RECV_F0<1"
    with pytest.raises(PlanError, match=r"rank 1's 1SEND_F0>2 has no matching receive on "
                                        r"rank 2"):
        check_deadlock_free(replace(s, ranks=tuple(map(tuple, ranks))))
    ranks = [list(acts) for acts in s.ranks]
    ranks[0].remove(Action("SEND", 1, 0, start_us=ranks[0][3].start_us, peer=1, moves="F"))
    with pytest.raises(PlanError, match=r"rank 1's 1RECV_F1<0 has no matching send on rank 0"):
        check_deadlock_free(replace(s, ranks=tuple(map(tuple, ranks))))
    lonely = parse_schedule("rank 0: 0F0 0B0\nrank 1: 1RECV_F0<0 1F0 1B0")
    with pytest.raises(PlanError, match="1RECV_F0<0 has no matching send on rank 0"):
        check_deadlock_free(lonely)


def test_checker_infers_peers_like_torch_strings():
    torch_style = parse_schedule("rank 0: 0F0 0SEND_F0 0RECV_B0 0B0\n"
                                 "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0")
    check_deadlock_free(torch_style)
    with pytest.raises(PlanError, match="cannot infer the peer of rank 0's 0SEND_F0"):
        check_deadlock_free(parse_schedule("rank 0: 0F0 0SEND_F0\nrank 1: 1F0\nrank 2: 1F0"))
    with pytest.raises(PlanError, match="not another rank"):
        check_deadlock_free(parse_schedule("rank 0: 0F0 0SEND_F0>0\nrank 1: 1RECV_F0<0 1F0"))
    with pytest.raises(PlanError, match=r"moves past the first or last stage \(0\.\.0\)"):
        check_deadlock_free(parse_schedule("rank 0: 0RECV_F0<1 0F0\nrank 1: 0F0"))


def test_checker_rejects_order_and_collective_deadlocks():
    with pytest.raises(PlanError, match=r"rank 0 waits at action 0 \(0B0\): needs its own 0F0"):
        check_deadlock_free(parse_schedule("rank 0: 0B0 0F0"))
    with pytest.raises(PlanError, match=r"1F0\): needs the activation of 0F0"):
        check_deadlock_free(parse_schedule("rank 0: 0F0 0B0\nrank 1: 1F0 1B0"))
    with pytest.raises(PlanError, match=r"needs every B of stage 0 on this rank first"):
        check_deadlock_free(parse_schedule("rank 0: 0F0 0A 0B0"))
    s = tick_tock(2, 2)  # rank 1 joins the waves' all-reduces in the other order
    acts = list(s.ranks[1])
    i, j = (k for k, a in enumerate(acts) if a.kind == "A" and a.batch in (0, 1))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(PlanError, match=r"rank 0 waits at action \d+ \(T:0A\): collective "
                                        r"over ranks \[0, 1\]: rank 1 waits at"):
        check_deadlock_free(replace(s, ranks=(s.ranks[0], tuple(acts))))
    with pytest.raises(PlanError, match="runs 2 time"):
        check_deadlock_free(parse_schedule("rank 0: 0F0 0B0 0A 0A\nrank 1: 0F0 0B0 0A"))
    with pytest.raises(PlanError, match="names stage 3 of 1"):
        check_deadlock_free(Schedule("x", ((Action("F", 0, 3),),)))


def test_with_transfers_rejects_bad_compute_orders():
    with pytest.raises(PlanError, match="the compute orders deadlock"):
        with_transfers("x", [[Action("B", 0, 0), Action("F", 0, 0)]], 1, 1, {})
    with pytest.raises(PlanError, match="runs on ranks 0 and 1"):
        with_transfers("x", [[Action("F", 0, 0)], [Action("F", 0, 0)]], 1, 1, {})
    with pytest.raises(PlanError, match="its forward runs on rank 0"):
        with_transfers("x", [[Action("F", 0, 0)], [Action("B", 0, 0)]], 1, 1, {})
    with pytest.raises(PlanError, match="give compute only"):
        with_transfers("x", [[Action("SEND", 0, 0, peer=1, moves="F")]], 1, 1, {})


@pytest.mark.parametrize("call,match", [
    (lambda: gpipe(0, 1), r"gpipe\(ranks=0\): need an integer >= 1"),
    (lambda: one_f_one_b(2, 0), r"one_f_one_b\(microbatches=0\)"),
    (lambda: one_f_one_b(2.0, 2), r"one_f_one_b\(ranks=2.0\)"),
    (lambda: gpipe(True, 2), r"gpipe\(ranks=True\)"),
    (lambda: round_robin(-1), r"round_robin\(ranks=-1\)"),
    (lambda: tick_tock(2, 0), r"tick_tock\(steps=0\)"),
    (lambda: gpipe(2, 2, fwd_us=0), r"gpipe\(fwd_us=0\): need a positive time"),
])
def test_builders_validate_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_builders_are_deterministic_and_infer_shape():
    assert one_f_one_b(5, 7) == one_f_one_b(5, 7)
    assert format_schedule(round_robin(4)) == format_schedule(round_robin(4))
    s = from_actions("x", [[parse_action("1F3")], [parse_action("0B0")]])
    assert (s.partitions, s.batches, s.data_parallel) == (2, 4, False)
    assert from_actions("x", [[Action("F")], [Action("F")]]).data_parallel
