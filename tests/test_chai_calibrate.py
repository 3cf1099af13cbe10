"""CHAI's offline phase: k-means error curves, the elbow rule, membership with KV-head cover,
the accuracy-budgeted choice of k per layer, and the plan's JSON round trip."""
import math

import pytest
import torch

from tidal.ir.head_clusters import (average_linkage, first_best, head_features, membership,
                                    online_memberships, representatives, tie_stable_order)
from tidal.ir.plan import Plan
from tidal.ir.plans.chai import ChaiPlan, LayerChoice
from tidal.passes.chai_calibrate import (Budget, choose_counts, elbow, kmeans_errors,
                                         nearest_centres, split_holdout, verdict)
from tidal.passes.clustered_attention import (ClusteredAttention, calibrate, clustered_graph,
                                              perplexity)
from tidal.passes.clustered_attention import chai_modules
from examples.models import llama_small

from test_attention_match import TorchEncoder


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

    choice = choose_counts(errors, evaluate, Budget(tolerance=0.03), 10.0, margin=1.0)
    assert choice.counts == {0: 2, 1: None}
    assert choice.metric == pytest.approx(10.1)
    assert choice.evaluations <= 4 and choice.backed_off == ()


def additive(costs, baseline=10.0):
    """A metric that adds each clustered layer's relative cost (k does not matter)."""
    return lambda counts: baseline * (1 + sum(costs[l] for l, k in counts.items() if k))


# layers tried in order 0, 1, 2, 3 (most redundant first)
ERRORS = {l: (1.0, 0.1 + 0.1 * l, 0.05 + 0.1 * l, 0.0) for l in range(4)}


def test_margin_tightens_the_choice():
    cheap = additive({0: 0.002, 1: 0.002, 2: 0.02, 3: 0.002})
    # full budget (margin 1): layer 2's +2 % fits beside the others
    assert choose_counts(ERRORS, cheap, Budget(tolerance=0.03), 10.0,
                         margin=1.0).counts[2] == 1
    # default margin 0.5: chosen under +1.5 %, so layer 2 stays unclustered
    choice = choose_counts(ERRORS, cheap, Budget(tolerance=0.03), 10.0)
    assert choice.counts == {0: 1, 1: 1, 2: None, 3: 1}
    assert choice.metric <= 10.0 * 1.015 + 1e-12
    with pytest.raises(ValueError, match="margin"):
        Budget().tightened(0.0)


def costed(costs, baseline=10.0, heads=4):
    """A metric adding each clustered layer's relative cost, full at k = 1 and falling
    linearly to a third of it at k = H - 1 (k = H would cost nothing)."""
    return lambda counts: baseline * (1 + sum(costs[l] * (heads - k) / (heads - 1)
                                              for l, k in counts.items() if k))


def test_held_out_check_softens_last_accepted_layers():
    # On the choose split every layer looks cheap (+0.2 % each at k = 1); on the held-out
    # split layers 2 and 3 are expensive (+3 % each at k = 1, +1 % at k = 3).
    choose = costed({l: 0.002 for l in range(4)})
    check = costed({0: 0.002, 1: 0.002, 2: 0.03, 3: 0.03}, baseline=20.0)
    budget = Budget(tolerance=0.03)
    unchecked = choose_counts(ERRORS, choose, budget, 10.0)
    assert all(k == 1 for k in unchecked.counts.values())
    assert not budget.allows(check(unchecked.counts), 20.0)   # the choice overfits
    choice = choose_counts(ERRORS, choose, budget, 10.0, check=check, check_baseline=20.0)
    assert choice.counts == {0: 1, 1: 1, 2: 3, 3: 3}          # last two softened to H - 1
    assert choice.softened == (2, 3) and choice.backed_off == ()
    assert budget.allows(choice.held_out, 20.0)
    assert choice.held_out == pytest.approx(check(choice.counts))
    assert choice.metric == pytest.approx(choose(choice.counts))


def test_held_out_check_drops_last_accepted_layers():
    choose = costed({l: 0.001 for l in range(4)})
    check = costed({l: 0.05 for l in range(4)})       # +1.7 % per layer even at k = H - 1
    choice = choose_counts(ERRORS, choose, Budget(tolerance=0.03), 10.0, check=check,
                           check_baseline=10.0)
    assert choice.counts == {0: 3, 1: None, 2: None, 3: None}
    assert choice.backed_off == (3, 2, 1) and choice.softened == (0,)
    assert choice.held_out == pytest.approx(check(choice.counts))
    assert choice.metric == pytest.approx(choose(choice.counts))


def test_held_out_check_can_back_off_every_layer():
    choose = costed({l: 0.001 for l in range(4)})
    check = costed({l: 0.2 for l in range(4)})
    choice = choose_counts(ERRORS, choose, Budget(tolerance=0.03), 10.0, check=check,
                           check_baseline=10.0)
    assert choice.counts == {l: None for l in range(4)}
    assert choice.backed_off == (3, 2, 1, 0)
    assert choice.held_out == 10.0 and choice.metric == 10.0
    with pytest.raises(ValueError, match="check_baseline"):
        choose_counts(ERRORS, choose, Budget(), 10.0, check=check)


def test_cosine_budget_check():
    # embedding cosine: higher is better; the held-out split drops below 0.99 with layer 1
    choose = lambda counts: 1.0 - 0.001 * sum(bool(k) for k in counts.values())
    check = lambda counts: choose(counts) - (0.02 if counts.get(1) else 0.0)
    budget = Budget("cosine", min_cosine=0.99)
    assert budget.tightened(0.5).min_cosine == pytest.approx(0.995)
    choice = choose_counts(ERRORS, choose, budget, 1.0, check=check, check_baseline=1.0)
    assert choice.counts == {0: 3, 1: None, 2: None, 3: None}
    assert choice.backed_off == (3, 2, 1)


def test_split_holdout_interleaves_and_rejects_one_batch():
    assert split_holdout(list("abcd")) == (["a", "c"], ["b", "d"])
    assert split_holdout(list("abcdef"), 1 / 3) == (["a", "b", "d", "e"], ["c", "f"])
    with pytest.raises(ValueError, match="at least 2 batches"):
        split_holdout(["a"])
    with pytest.raises(ValueError, match="holdout"):
        split_holdout(list("ab"), 1.0)


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
    batches = [(torch.randint(0, 256, (2, 24)),) for _ in range(4)]
    plan = calibrate(model, batches, budget=Budget(tolerance=0.03))
    assert len(plan.layers) == 2 and all(len(c.errors) == 4 for c in plan.layers)
    assert plan.final_metric <= plan.baseline_metric * 1.015 + 1e-9     # internal budget
    # the held-out metric is the chosen model's perplexity on the held-out batches 1 and 3
    held = [batches[1], batches[3]]
    orig = perplexity(clustered_graph(model, batches[0]), held)
    chosen = perplexity(clustered_graph(model, batches[0], ClusteredAttention(plan=plan)), held)
    assert plan.held_out_baseline == pytest.approx(orig)
    assert plan.held_out_metric == pytest.approx(chosen)
    assert chosen <= orig * 1.03
    assert all(1 <= c.elbow_k <= 4 for c in plan.layers)
    loose = calibrate(model, batches, budget=Budget(tolerance=10.0))
    assert loose.counts() == {0: 1, 1: 1}
    assert all(c.static_reps and len(c.static_labels) == 4 for c in loose.layers)
    never = calibrate(model, batches, budget=Budget(tolerance=-1.0), model_name="tiny")
    assert never.counts() == {0: None, 1: None}
    assert "too little head redundancy" in never.verdict
    with pytest.raises(ValueError, match="at least 2 batches"):
        calibrate(model, batches[:1])


def test_calibrate_torch_transformer_encoder_with_cosine_budget():
    """The offline phase observes the attention inside nn.TransformerEncoder (kept whole by
    fx) and plans every layer; the chosen plan meets the budget and leaves the model alone."""
    torch.manual_seed(0)
    model = TorchEncoder(causal=True).eval()
    batches = [(torch.randn(2, 12, 16),) for _ in range(4)]
    plan = calibrate(model, batches, budget=Budget("cosine", min_cosine=0.9),
                     embed=lambda out, batch: out)
    assert [c.scope for c in plan.layers] == [f"encoder.layers.{i}.self_attn" for i in range(2)]
    assert all(len(c.errors) == 4 and c.num_heads == 4 for c in plan.layers)
    assert any(c.chosen_k is not None for c in plan.layers)     # not vacuous
    assert plan.final_metric >= 0.95                            # the tightened budget
    gm = clustered_graph(model, batches[0], ClusteredAttention(plan=plan))
    with torch.no_grad():
        gm(*batches[1])
    assert [m.k for m in chai_modules(gm)] == [c.chosen_k for c in plan.layers]
    assert all(m.last_membership for m in chai_modules(gm) if m.k is not None)
    assert type(model.encoder.layers[0].self_attn) is torch.nn.MultiheadAttention


def test_mildest_useful_k_counts_the_decodes_score_rows():
    from tidal.passes.chai_calibrate import decode_score_rows, mildest_useful_k

    # SmolLM2: 9 query heads on 3 KV heads. 7 or 8 clusters need every KV head and 3 rows
    # each (9 rows, nothing saved); 6 fit on 2 KV heads (6 rows)
    assert [decode_score_rows(k, 9, 3) for k in range(1, 10)] == [1, 2, 3, 4, 6, 6, 9, 9, 9]
    assert mildest_useful_k(9, 3) == 6
    assert mildest_useful_k(12, 12) == 11      # multi-head attention: rows = k
    assert mildest_useful_k(8, 1) == 7         # one KV head: rows = k
    assert mildest_useful_k(4, 2) == 2


def test_choose_counts_never_keeps_a_k_that_saves_nothing():
    # a model whose metric only tolerates k >= 7 of 9: with the decode's real saving counted,
    # no useful k fits, so every layer stays unclustered
    errors = {l: tuple(1 - i / 8 - 0.01 * l for i in range(9)) for l in range(2)}

    def evaluate(counts):
        return 10.0 * (1 + sum(0.5 for k in counts.values() if k < 7))

    old = choose_counts(errors, evaluate, Budget(tolerance=0.03), 10.0)
    assert set(old.counts.values()) == {7}
    mild = {l: 6 for l in errors}
    new = choose_counts(errors, evaluate, Budget(tolerance=0.03), 10.0, mildest=mild)
    assert set(new.counts.values()) == {None} and new.metric == 10.0


# --- ties: every clustering decision is the same on every machine (lowest index wins) ---

def up(x, steps=1):
    """``x`` nudged up by ``steps`` ulps (float64)."""
    t = torch.tensor(float(x), dtype=torch.float64)
    for _ in range(steps):
        t = torch.nextafter(t, torch.tensor(math.inf, dtype=torch.float64))
    return t.item()


def test_representative_tie_goes_to_the_lowest_head():
    # a 2-member cluster: both heads are equally central; rounding noise of one ulp on the
    # diagonal or on one off-diagonal entry must not decide
    # (one KV head, so that the KV-head cover leaves every member eligible)
    for sim in ([[1.0, 0.9], [0.9, up(1.0, 4)]], [[1.0, 0.9], [up(0.9, 4), 1.0]]):
        assert representatives((0, 0), torch.tensor(sim, dtype=torch.float64), (0, 0)) == (0,)
    # 3 members, heads 0 and 1 equally similar to head 2 up to a few ulps
    sim = torch.tensor([[1.0, 0.95, 0.8], [0.95, 1.0, up(0.8, 4)], [0.8, up(0.8, 4), 1.0]],
                       dtype=torch.float64)
    assert representatives((0, 0, 0), sim, (0, 0, 0)) == (0,)


def test_average_linkage_tie_merges_the_lowest_pair():
    sim = torch.tensor([[1.0, 0.5, up(0.5, 2)], [0.5, 1.0, 0.1], [up(0.5, 2), 0.1, 1.0]],
                       dtype=torch.float64)
    assert average_linkage(sim, 2) == (0, 0, 1)


def test_elbow_tie_takes_the_lowest_k():
    # the gaps below the chord at k = 2 and k = 3 agree up to rounding noise
    assert elbow([1.0, 0.35, 0.1 - 1e-15, 0.05, 0.0]) == 2
    # a straight line with noise is no elbow
    assert elbow([1.0, 0.75 - 1e-15, 0.5, 0.25, 0.0]) == 5


def test_kmeans_assignment_tie_takes_the_lowest_centre():
    x = torch.tensor([[0.0], [1.0], [2.0]], dtype=torch.float64)
    centres = torch.tensor([[0.5 - 1e-13], [1.5]], dtype=torch.float64)
    assert nearest_centres(x, centres).tolist() == [0, 0, 1]


def test_layers_with_tying_redundancy_are_tried_in_layer_order():
    errors = {0: (1.0, 0.5, 0.25, 0.0), 1: (1.0, 0.5, 0.25 - 1e-13, 0.0)}
    logs = []
    choose_counts(errors, lambda counts: 10.0, Budget(), 10.0, logs.append)
    assert logs[0].startswith("layer 0")


def test_first_best_and_tie_stable_order():
    score = {0: 0.5, 1: up(0.5), 2: 0.9, 3: 0.1}.__getitem__
    assert first_best([1, 0, 2, 3], score) == 2
    assert first_best([0, 1, 3], score) == 0 and first_best([1, 0, 3], score) == 1
    assert first_best([0, 1, 2, 3], score, lowest=True) == 3
    assert tie_stable_order([0, 1, 2, 3], score) == [3, 0, 1, 2]
    assert tie_stable_order([1, 0, 2, 3], score) == [3, 1, 0, 2]


def test_online_membership_features_ignore_keys_past_the_first_tokens():
    # causal probabilities of the first 5 tokens give the same features whether the sequence
    # has 5 keys (decode prefill) or 12 (the graph), and, computed either way (a softmax over
    # 5 or 12 columns rounds differently), the same membership
    torch.manual_seed(0)
    scores = torch.randn(1, 4, 12, 12)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, -math.inf).softmax(-1)
    assert torch.equal(head_features(probs[0]), head_features(probs[0, :, :5, :5]))
    head = scores[..., :5, :5].masked_fill(~causal[:5, :5], -math.inf).softmax(-1)
    torch.testing.assert_close(head_features(probs[0]), head_features(head[0]))
    assert online_memberships(probs, 2, (0, 0, 1, 1)) == online_memberships(head, 2, (0, 0, 1, 1))


def test_paper_mode_takes_every_elbow_and_clusters_by_kmeans_beside_the_budgeted_plan():
    # mode="paper": k at each layer's elbow, K-means membership online, the budget measured
    # (not enforced); both plans side by side on the same batches
    from tidal.ir.head_clusters import kmeans_labels, membership

    torch.manual_seed(0)
    model = llama_small().eval()
    batches = [(torch.randint(0, 256, (2, 24)),) for _ in range(4)]
    paper = calibrate(model, batches, mode="paper")
    budgeted = calibrate(model, batches, budget=Budget(tolerance=0.03))
    assert paper.clustering == "kmeans" and budgeted.clustering == "linkage"
    assert [c.chosen_k for c in paper.layers] == [c.elbow_k for c in paper.layers]
    assert [c.errors for c in paper.layers] == [c.errors for c in budgeted.layers]
    assert "paper" in paper.budget and paper.final_metric > 0 and paper.held_out_metric > 0
    assert Plan.from_json(paper.to_json()) == paper
    gm = clustered_graph(model, batches[0], ClusteredAttention(plan=paper))
    with torch.no_grad():
        gm(*batches[1])
    clustered = [m for m in chai_modules(gm) if m.k is not None]
    assert clustered and all(m.clustering == "kmeans" for m in clustered)
    # the graph's online membership is K-means on the first tokens' attention
    for m in clustered:
        probs_features = torch.randn(m.num_heads, 10)
        assert membership(probs_features, m.k, m.kv_of_head, "kmeans").labels == \
            kmeans_labels(probs_features, m.k)
    with pytest.raises(ValueError, match="mode must be"):
        calibrate(model, batches, mode="elbow")
    with pytest.raises(ValueError, match="clustering must be"):
        ClusteredAttention(clusters=2, clustering="spectral")


def test_kmeans_is_deterministic_and_separates_clear_groups():
    from tidal.ir.head_clusters import kmeans_labels

    g = torch.Generator().manual_seed(3)
    centres = torch.eye(3) * 10
    rows = torch.cat([centres[c] + 0.1 * torch.randn(3, 3, generator=g) for c in (2, 0, 1)])
    assert kmeans_labels(rows, 3) == (0, 0, 0, 1, 1, 1, 2, 2, 2)
    assert kmeans_labels(rows, 3) == kmeans_labels(rows.clone(), 3)
    assert kmeans_labels(rows, 1) == (0,) * 9 and kmeans_labels(rows, 9) == tuple(range(9))
