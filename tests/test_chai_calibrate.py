"""CHAI's offline phase: k-means error curves, the elbow rule, membership with KV-head cover,
the accuracy-budgeted choice of k per layer, and the plan's JSON round trip."""
import pytest
import torch

from tidal.ir.plan import Plan
from tidal.passes.chai_calibrate import (Budget, ChaiPlan, LayerChoice, choose_counts, elbow,
                                         kmeans_errors, membership, verdict)
from tidal.passes.clustered_attention import calibrate
from examples.models import llama_small


def grouped_points(groups, per_group=3, dim=16, noise=0.01, seed=0):
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(groups, dim, generator=gen) * 3
    return torch.cat([c + noise * torch.randn(per_group, dim, generator=gen) for c in centres])


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_elbow_finds_the_number_of_well_separated_groups(groups):
    errors = kmeans_errors(grouped_points(groups))
    assert all(a >= b - 1e-9 for a, b in zip(errors, errors[1:]))
    assert errors[-1] == 0.0
    assert elbow(errors) == groups


def test_elbow_of_unredundant_heads_is_all_heads():
    assert elbow([8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]) == 9   # straight line
    assert elbow([0.0, 0.0, 0.0]) == 1                                  # identical heads


def test_membership_groups_alike_heads_and_minimises_kv_heads():
    f = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0.99, 0.05, 0], [0.02, 1, 0]])
    m = membership(f, 2, kv_of_head=(0, 0, 1, 1))
    assert m.labels == (0, 1, 0, 1)
    assert {h // 2 for h in m.representatives} == {0}     # both reps on KV head 0
    assert m.rep_of_head == (0, 1, 0, 1)


def test_choose_counts_respects_budget_and_leaves_layers_unclustered():
    # layer 0: very redundant, fine at k >= 2; layer 1: any k < H costs too much.
    errors = {0: (1.0, 0.1, 0.05, 0.0), 1: (1.0, 0.8, 0.5, 0.0)}
    cost = {0: {1: 0.5, 2: 0.01, 3: 0.0}, 1: {1: 9.0, 2: 5.0, 3: 1.0}}

    def evaluate(counts):
        return 10.0 * (1 + sum(cost[l][k] for l, k in counts.items()))

    counts, final, evals = choose_counts(errors, evaluate, Budget(tolerance=0.03), 10.0)
    assert counts == {0: 2, 1: None}
    assert final == pytest.approx(10.1)
    assert evals <= 4


def test_plan_json_round_trip_and_table():
    layers = (LayerChoice(0, "m.l0", 4, 2, 16, 2, 2, (4.0, 1.0, 0.5, 0.0), (0, 1, 0, 1), (0, 1)),
              LayerChoice(1, "m.l1", 4, 2, 16, None, 3, (4.0, 3.0, 1.0, 0.0)))
    plan = ChaiPlan(layers, budget="perplexity within +3.0%", baseline_metric=10.0,
                    final_metric=10.2, verdict=verdict(layers))
    again = Plan.from_json(plan.to_json())
    assert again == plan and isinstance(again, ChaiPlan)
    assert "elbow" in plan.table() and plan.counts() == {0: 2, 1: None}
    with pytest.raises(ValueError, match="outside 1..4"):
        LayerChoice(0, "m.l0", 4, 2, 16, 5, 2)


def test_calibrate_tiny_lm_within_budget_and_verdicts():
    torch.manual_seed(0)
    model = llama_small().eval()
    batches = [(torch.randint(0, 256, (2, 24)),) for _ in range(2)]
    plan = calibrate(model, batches, budget=Budget(tolerance=0.03))
    assert len(plan.layers) == 2 and all(len(c.errors) == 4 for c in plan.layers)
    assert plan.final_metric <= plan.baseline_metric * 1.03
    assert all(1 <= c.elbow_k <= 4 for c in plan.layers)
    loose = calibrate(model, batches, budget=Budget(tolerance=10.0))
    assert loose.counts() == {0: 1, 1: 1}
    assert all(c.static_reps and len(c.static_labels) == 4 for c in loose.layers)
    never = calibrate(model, batches, budget=Budget(tolerance=-1.0), model_name="tiny")
    assert never.counts() == {0: None, 1: None}
    assert "too little head redundancy" in never.verdict
