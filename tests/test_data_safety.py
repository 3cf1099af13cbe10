"""Data safety: a corrupt or foreign weight store is refused naming the tensor at fault, a plan's
kind never imports a module, a replayed burst plan must fit the cluster it runs on, and a
rank's owner-only burst checkpoint loads only on that rank."""
import dataclasses
import json
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import tidal
from tidal.ir.errors import PlanError
from tidal.ir.plan import CompiledPlan, Plan, plan_classes, plan_kind
from tidal.ir.plans.burst import BurstPlan
from tidal.passes.burst_planner import split_batch
from tidal.passes.layer_groups import LayerGroups
from tidal.runtime.program import ProgramExecutor
from tidal.runtime.programs.burst import BurstProgram
from tidal.runtime.programs.layer_groups import run_pipelined
from tidal.runtime.weights.loader import expected_specs, group_tensors, write_groups
from tidal.runtime.weights.store import WeightStore, WeightStoreError, write_store

from rank_parts import part, spawn_parts

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- weight store
def _mlp(*widths):
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).eval()


def _grouped(*widths):
    torch.manual_seed(0)
    model = _mlp(*widths)
    x = torch.randn(3, widths[0])
    compiled = tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer")])
    return model, x, compiled


def _header(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), 8 + n


def _overwrite(path, name, data: bytes):
    """Overwrite the stored bytes of tensor ``name`` with ``data`` (same length)."""
    header, start = _header(path)
    lo, hi = header[name]["data_offsets"]
    assert len(data) == hi - lo
    with open(path, "r+b") as f:
        f.seek(start + lo)
        f.write(data)


def test_store_round_trip_records_format_and_checksums(tmp_path):
    model, x, compiled = _grouped(4, 8, 8, 2)
    path = tmp_path / "w.safetensors"
    write_groups(compiled.graph_module, path)
    meta = _header(path)[0]["__metadata__"]
    assert meta["tidal.format"] == "tidal-layer-groups-3"
    assert sorted(json.loads(meta["tidal.crc32"])) == sorted(model.state_dict())
    with torch.no_grad():
        expected = model(x)
        for p in model.parameters():
            p.zero_()
    out, _ = run_pipelined(compiled.graph_module, path, (x,))
    assert torch.equal(out, expected)
    targets = group_tensors(compiled.graph_module)
    with WeightStore.open(path, expected_specs(targets)) as store:
        assert torch.equal(store.tensor("2.weight"), model[2].weight)


@pytest.mark.parametrize("fill", ["random", "nan"])
def test_corrupt_tensor_bytes_are_refused_naming_the_tensor(tmp_path, fill):
    model, x, compiled = _grouped(4, 8, 8, 2)
    path = tmp_path / "w.safetensors"
    write_groups(compiled.graph_module, path)
    weight = model[2].weight  # in group 2 of 5 (one group per layer)
    if fill == "random":
        data = torch.randint(0, 256, (weight.numel() * 4,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(3)).numpy().tobytes()
    else:
        data = torch.full_like(weight, float("nan")).detach().numpy().tobytes()
    _overwrite(path, "2.weight", data)
    with pytest.raises(WeightStoreError, match=r"tensor '2\.weight' \(group 2\) does not "
                                               r"match the checksum"):
        run_pipelined(compiled.graph_module, path, (x,))
    with pytest.raises(WeightStoreError, match=r"'2\.weight' \(group 2\)"):
        compiled.cold_start(path)
    targets = group_tensors(compiled.graph_module)
    with WeightStore.open(path, expected_specs(targets)) as store:
        with pytest.raises(WeightStoreError, match=r"'2\.weight'"):
            store.tensor("2.weight")


def test_whole_data_region_overwritten_names_the_first_tensor(tmp_path):
    model, x, compiled = _grouped(4, 8, 2)
    path = tmp_path / "w.safetensors"
    write_groups(compiled.graph_module, path)
    _, start = _header(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(torch.randint(0, 256, (size - start,), dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(WeightStoreError, match=r"tensor '0\.weight' \(group 0\)"):
        run_pipelined(compiled.graph_module, path, (x,))


def test_store_of_another_model_names_the_first_differing_tensor(tmp_path):
    _, x, compiled = _grouped(4, 8, 2)  # 2 groups
    _, _, other = _grouped(4, 8, 3, 2)  # 3 groups; '2.weight' is [3, 8] there, [2, 8] here
    path = tmp_path / "other.safetensors"
    write_groups(other.graph_module, path)
    with pytest.raises(WeightStoreError,
                       match=r"tensor '2\.weight' is F32\[3, 8\] in the file but F32\[2, 8\]"):
        run_pipelined(compiled.graph_module, path, (x,))
    # other names altogether (and another group count): the first expected name is missing,
    # and the message says what the store holds in its place
    write_store(path, [[("enc.w", torch.zeros(2, 2))], [("dec.w", torch.zeros(2))],
                       [("head.w", torch.zeros(1))]])
    with pytest.raises(WeightStoreError, match=r"tensor '0\.weight' is missing \(F32\[8, 4\] "
                                               r"in the model; the store has 'enc\.w' F32\[2, 2\]"):
        run_pipelined(compiled.graph_module, path, (x,))


@pytest.mark.parametrize("old, lacks", [("1", "without checksums"),
                                        ("2", "with 64-bit word-sum checksums")])
def test_store_of_an_older_tidal_must_be_rewritten(tmp_path, old, lacks):
    _, x, compiled = _grouped(4, 8, 2)
    path = tmp_path / "old.safetensors"
    write_groups(compiled.graph_module, path)
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"tidal-layer-groups-3", f"tidal-layer-groups-{old}".encode(),
                                 1))
    with pytest.raises(WeightStoreError, match=f"written by an older tidal \\(format "
                                               f"'tidal-layer-groups-{old}', {lacks}.*rewrite it"):
        run_pipelined(compiled.graph_module, path, (x,))


# ---------------------------------------------------------------- plan kinds
def _probe_module(tmp_path, monkeypatch):
    """A module on sys.path that records being imported (a file) and defines a Plan."""
    name = f"tidal_probe_{uuid.uuid4().hex}"
    flag = tmp_path / "imported"
    (tmp_path / f"{name}.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(flag)!r}).write_text('yes')\n"
        "from dataclasses import dataclass\n"
        "from tidal.ir.plan import Plan\n"
        "@dataclass(frozen=True)\n"
        "class X(Plan):\n"
        "    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, flag


def test_plan_kinds_never_import_a_module(tmp_path, monkeypatch):
    name, flag = _probe_module(tmp_path, monkeypatch)
    plan_classes()  # the registered passes' modules: the only imports a plan lookup makes
    before = set(sys.modules)
    for kind in (f"{name}:X", name, "os:system", "subprocess:Popen", "os.path:join"):
        with pytest.raises(PlanError, match="unknown plan kind"):
            Plan.from_json(json.dumps({"kind": kind, "data": {}}))
    nested = {"kind": "CompiledPlan", "data": {"passes": [["p", {"kind": f"{name}:X",
                                                                 "data": {}}]]}}
    with pytest.raises(PlanError, match="unknown plan kind"):
        CompiledPlan.from_json(json.dumps(nested))
    # an old "module:QualName" kind resolves by its registered QualName, the module unread
    legacy = Plan.from_json(json.dumps({"kind": f"{name}:CompiledPlan",
                                        "data": {"passes": []}}))
    assert legacy == CompiledPlan(())
    assert not flag.exists() and name not in sys.modules
    assert set(sys.modules) == before


def test_legacy_module_kinds_and_registered_names(tmp_path):
    from tidal.ir.plans.layer_groups import LayerGroupPlan

    _, _, compiled = _grouped(4, 8, 2)
    plan = compiled.plan.get("layer_groups")
    text = CompiledPlan((("layer_groups", plan),)).to_json()
    assert '"kind": "LayerGroupPlan"' in text and "tidal.passes" not in text
    old = text.replace('"LayerGroupPlan"', '"tidal.passes.group_planner:LayerGroupPlan"')
    old = old.replace('"CompiledPlan"', '"tidal.ir.plan:CompiledPlan"')
    assert CompiledPlan.from_json(old).get("layer_groups") == plan
    assert {"BurstPlan", "TickTockPlan", "RoundRobinPlan", "LayerGroupPlan", "CompressionPlan",
            "ChaiPlan", "Schedule", "CompiledPlan"} <= {plan_kind(c) for c in plan_classes()}
    assert plan_kind(LayerGroupPlan) == "LayerGroupPlan"


def test_plan_classes_are_known_in_a_fresh_process():
    """Only ``tidal.ir.plan`` imported: the plans of every pass decode (tidal imports them)."""
    _, x, compiled = _grouped(4, 8, 2)
    burst = tidal.compile(_mlp(4, 8, 2), (x[:2],), passes=["burst_parallel"],
                          cluster=tidal.Cluster(gpus=2, bandwidth_gbps=100, latency_us=5))
    text = CompiledPlan((("layer_groups", compiled.plan.get("layer_groups")),
                         ("burst_parallel", burst.plan.get("burst_parallel")))).to_json()
    code = ("import sys; from tidal.ir.plan import CompiledPlan, plan_classes, plan_kind\n"
            "p = CompiledPlan.from_json(sys.stdin.read())\n"
            "print(sorted(type(q).__name__ for _, q in p.passes))\n"
            "print(sorted(plan_kind(c) for c in plan_classes()))\n")
    out = subprocess.run([sys.executable, "-c", code], input=text, capture_output=True,
                         text=True, cwd=ROOT.parent, check=True).stdout.splitlines()
    assert out[0] == "['BurstPlan', 'LayerGroupPlan']"
    for kind in ("TickTockPlan", "RoundRobinPlan", "CompressionPlan", "ChaiPlan", "Schedule"):
        assert f"'{kind}'" in out[1]


def test_two_plan_classes_of_one_name_need_their_own_kind():
    def make(module):
        cls = dataclasses.make_dataclass("Twin", [("n", int)], bases=(Plan,), frozen=True)
        cls.__module__ = module
        return cls

    first, second = make("somewhere.a"), make("somewhere.b")
    with pytest.raises(PlanError, match="'Twin' is ambiguous"):
        first(1).to_json()
    second.plan_kind = "twin_b"
    assert Plan.from_json(first(1).to_json()) == first(1)
    assert Plan.from_json(second(2).to_json()) == second(2)


# ---------------------------------------------------------------- burst plans vs the cluster
def _burst(gpus):
    return tidal.Cluster(gpus=gpus, bandwidth_gbps=100, latency_us=5, peak_tflops=1e-4)


def _widened(plan: BurstPlan, layer: int, gpus: int) -> BurstPlan:
    """``plan`` with layer ``layer`` on ``gpus`` GPUs, whatever the cluster has."""
    l = plan.layers[layer]
    wide = dataclasses.replace(l, gpus=gpus, ranks=tuple(range(gpus)),
                               ranges=split_batch(plan.batch, gpus))
    return dataclasses.replace(plan, layers=plan.layers[:layer] + (wide,)
                               + plan.layers[layer + 1:])


def test_replayed_plan_needing_more_gpus_than_the_cluster_is_refused():
    torch.manual_seed(0)
    model = _mlp(16, 32, 10).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    plan = tidal.compile(model, (x,), passes=["burst_parallel"],
                         cluster=_burst(2)).plan.get("burst_parallel")
    bad = _widened(plan, 1, 4)
    name = bad.layers[1].layer
    for given in (bad, bad.to_json()):
        with pytest.raises(PlanError, match=rf"layer '{name}' needs 4 GPUs, but the cluster "
                                            r"has 2"):
            tidal.compile(model, (x,), passes=["burst_parallel"], cluster=_burst(2), plan=given)
    odd = dataclasses.replace(plan, layers=(dataclasses.replace(
        plan.layers[0], ranges=((0, 3), (5, 8))),) + plan.layers[1:])
    with pytest.raises(PlanError, match="do not split the batch of 8"):
        tidal.compile(model, (x,), passes=["burst_parallel"], cluster=_burst(2), plan=odd)


def _executor_beyond_world(rank, size):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    gm = fx.symbolic_trace(model)
    ex = ProgramExecutor(BurstProgram(world=size, batch=4,
                                      param_ranks=(("0.weight", (0, 1)), ("0.bias", (0, 1))),
                                      layer_ranks=(("_0", tuple(range(2 * size))),)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        ex.step(gm, model, (torch.randn(4, 3),), torch.tensor([0, 1, 0, 1]), F.cross_entropy,
                opt)
    except PlanError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def two_rank_job():
    """One 2-rank job for both 2-rank cases of this module: {case: the ranks' results}."""
    return spawn_parts(2, [part(_executor_beyond_world), part(_foreign_checkpoints)],
                       timeout_s=300)


def test_executor_refuses_a_layer_needing_more_ranks_than_the_world(two_rank_job):
    for message in two_rank_job["_executor_beyond_world"]:
        assert message is not None and "layer '_0' needs 4 GPUs, but the world has 2" in message


def _foreign_checkpoints(rank, size):
    """Rank 0 alone owns layer 0, both ranks own layer 1: each rank's own checkpoint, altered
    to claim another rank or world, a tensor it does not own or lacks, or a wrong shape."""
    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)))
    program = BurstProgram(world=size, batch=4, param_ranks=(
        ("0.weight", (0,)), ("0.bias", (0,)), ("1.weight", (0, 1)), ("1.bias", (0, 1))))
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    dropped = program.own_optimizer(opt, gm)
    mine = program.state_dict(gm, opt)
    model = dict(mine["model"])
    if rank == 0:
        model.pop("0.bias")
    else:
        model["0.bias"] = torch.zeros(4)
    bad = [dict(mine, rank=1 - rank), dict(mine, world=4), dict(mine, model=model),
           dict(mine, model={**mine["model"], "1.weight": torch.zeros(3, 3)})]
    messages = []
    for state in bad:
        try:
            program.load_state_dict(gm, state, opt)
        except ValueError as e:
            messages.append(str(e))
    program.load_state_dict(gm, mine, opt)  # its own checkpoint loads
    return (dropped, sorted(mine["model"]), [len(g["params"]) for g in opt.param_groups],
            messages)


def test_a_burst_checkpoint_loads_only_on_the_rank_that_owns_it(two_rank_job):
    (d0, own0, groups0, m0), (d1, own1, groups1, m1) = two_rank_job["_foreign_checkpoints"]
    assert d0 == [] and d1 == ["0.weight", "0.bias"]  # the optimizer keeps owned parameters
    assert own0 == ["0.bias", "0.weight", "1.bias", "1.weight"] and own1 == ["1.bias", "1.weight"]
    assert groups0 == [4] and groups1 == [2]
    for rank, messages in ((0, m0), (1, m1)):
        assert len(messages) == 4, messages
        assert f"checkpoint is rank {1 - rank} of 2, but this is rank {rank} of 2" in messages[0]
        assert f"checkpoint is rank {rank} of 4" in messages[1]
        assert "tensor '1.weight' has shape (3, 3), the model (2, 4)" in messages[3]
    assert "tensor '0.bias' is missing for this rank" in m0[2]
    assert "tensor '0.bias' is not owned by this rank" in m1[2]


def test_checksum_sees_every_byte_and_swapped_words():
    from tidal.runtime.weights.store import checksum

    data = bytearray(torch.arange(13, dtype=torch.uint8).numpy().tobytes())
    base = checksum(bytes(data))
    assert base == checksum(torch.arange(13, dtype=torch.uint8).numpy())  # any buffer
    for i in (0, 7, 8, 12):
        changed = bytearray(data)
        changed[i] ^= 0x10
        assert checksum(bytes(changed)) != base, i
    words = torch.arange(16, dtype=torch.uint8).numpy().tobytes()
    swapped = words[8:] + words[:8]  # the same two words, swapped: a word sum misses it
    assert checksum(swapped) != checksum(words)
    assert checksum(b"") == 0
