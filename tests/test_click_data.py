"""Click data for the recommendation models: synthetic ClickData and the Criteo TSV loader."""
import doctest
import math

import pytest
import torch

import examples.data.clicks
import examples.data.criteo
from examples.data import ClickData, CriteoTSV


def _ids(data, batches, table=0):
    return torch.cat([data.batch(i)[0][1][:, table] for i in range(batches)])


@pytest.mark.parametrize("module", [examples.data.clicks, examples.data.criteo, examples.data])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_shapes_dtypes_and_ranges():
    rows = (7, 50, 300)
    data = ClickData(num_dense=5, table_rows=rows, batch_size=64, alpha=0.8)
    (dense, sparse), labels = data.batch(3)
    assert dense.shape == (64, 5) and dense.dtype == torch.float32
    assert sparse.shape == (64, 3) and sparse.dtype == torch.int64
    assert labels.shape == (64,) and labels.dtype == torch.float32
    assert bool((dense >= 0).all()) and bool(torch.isfinite(dense).all())
    assert set(labels.unique().tolist()) <= {0.0, 1.0}
    assert bool((sparse >= 0).all())
    for t, r in enumerate(rows):
        assert int(sparse[:, t].max()) < r
    assert data.num_tables == 3


def test_same_seed_and_index_give_the_same_batch():
    kwargs = dict(num_dense=3, table_rows=(100, 1000), batch_size=32, alpha=1.1, seed=7)
    a, b = ClickData(**kwargs), ClickData(**kwargs)
    for i in (0, 5, 123456789):
        (da, sa), la = a.batch(i)
        (db, sb), lb = b.batch(i)
        assert torch.equal(da, db) and torch.equal(sa, sb) and torch.equal(la, lb)
    # Out of order access gives the same batch too.
    assert torch.equal(a.batch(2)[0][1], ClickData(**kwargs).batch(2)[0][1])


def test_different_index_or_seed_gives_a_different_batch():
    kwargs = dict(num_dense=3, table_rows=(100, 1000), batch_size=32)
    data = ClickData(**kwargs)
    (d0, s0), _ = data.batch(0)
    (d1, s1), _ = data.batch(1)
    assert not torch.equal(d0, d1) and not torch.equal(s0, s1)
    (d2, s2), _ = ClickData(**kwargs, seed=1).batch(0)
    assert not torch.equal(d0, d2) and not torch.equal(s0, s2)


def test_zipf_alpha_controls_the_skew():
    rows, n = 1000, 20
    steep = _ids(ClickData(1, (rows,), 1000, alpha=1.5), n)
    flat = _ids(ClickData(1, (rows,), 1000, alpha=0.5), n)
    top_steep = torch.bincount(steep, minlength=rows).max().item() / steep.numel()
    top_flat = torch.bincount(flat, minlength=rows).max().item() / flat.numel()
    # Theory: 1 / H(1000, 1.5) = 0.39 and 1 / H(1000, 0.5) = 0.016.
    expected = 1.0 / sum((r + 1) ** -1.5 for r in range(rows))
    assert abs(top_steep - expected) < 0.02
    assert top_flat < 0.03
    assert top_steep > 10 * top_flat


def test_zipf_frequencies_follow_the_stated_probabilities():
    data = ClickData(1, (50,), 2000, alpha=1.0, seed=3)
    ids = _ids(data, 10)
    empirical = torch.bincount(ids, minlength=50).double() / ids.numel()
    probabilities = data.id_probabilities(0)
    assert math.isclose(float(probabilities.sum()), 1.0, rel_tol=1e-12)
    # 20,000 draws: every frequency within 4 standard deviations of its probability.
    std = (probabilities * (1 - probabilities) / ids.numel()).sqrt()
    assert bool(((empirical - probabilities).abs() <= 4 * std + 1e-12).all())
    # The most popular ids are scattered by the permutation, not the first ids.
    assert sorted(probabilities.topk(5).indices.tolist()) != [0, 1, 2, 3, 4]


@pytest.mark.parametrize("hot_share", [0.9, 0.01])
def test_hot_fraction_receives_hot_share_of_accesses(hot_share):
    rows = 2000
    data = ClickData(1, (rows,), 10_000, hot_fraction=0.01, hot_share=hot_share, seed=2)
    ids = _ids(data, 4)
    hot = data.id_probabilities(0).topk(20).indices
    share = torch.isin(ids, hot).double().mean().item()
    assert abs(share - hot_share) < 0.03
    if hot_share == 0.9:
        # The busiest 1 % of ids, found from the sample alone, carry about 90 % of accesses.
        counts = torch.bincount(ids, minlength=rows).sort(descending=True).values
        assert abs(counts[:20].sum().item() / ids.numel() - 0.9) < 0.03


def test_labels_depend_on_the_features():
    data = ClickData(4, (100, 100), 4000, alpha=1.0)
    (dense, sparse), labels = data.batch(0)
    rate = labels.mean().item()
    assert 0.1 < rate < 0.6
    # Samples sharing the most frequent id of table 0 click at a rate far from the one of the
    # samples sharing the second most frequent id: the label is a function of the ids.
    ids = sparse[:, 0]
    first, second = torch.bincount(ids, minlength=100).topk(2).indices.tolist()
    rates = [labels[ids == i].mean().item() for i in (first, second)]
    assert abs(rates[0] - rates[1]) > 0.05


@pytest.mark.parametrize("kwargs,argument", [
    (dict(alpha=0.0), "alpha"),
    (dict(alpha=-1.0), "alpha"),
    (dict(alpha=float("nan")), "alpha"),
    (dict(hot_fraction=0.01, hot_share=1.0), "hot_share"),
    (dict(hot_fraction=0.01, hot_share=0.0), "hot_share"),
    (dict(hot_fraction=1.5, hot_share=0.5), "hot_fraction"),
    (dict(hot_fraction=0.01), "hot_share"),
    (dict(batch_size=0), "batch_size"),
    (dict(table_rows=(10, 0)), r"table_rows\[1\]"),
    (dict(num_dense=0), "num_dense"),
])
def test_bad_arguments_are_named(kwargs, argument):
    full = dict(num_dense=2, table_rows=(10, 20), batch_size=4) | kwargs
    with pytest.raises(ValueError, match=f"ClickData: .*{argument}"):
        ClickData(**full)


def test_bad_batch_index_is_named():
    data = ClickData(2, (10,), 4)
    with pytest.raises(ValueError, match="i must be an int >= 0"):
        data.batch(-1)


CATS = ["68fd1e64", "80e26c9b", "", "fb936136", "7b4723c4", "25c83c98", "7e0ccccf", "de7995b8",
        "1f89b562", "a73ee510", "a8cd5504", "b2cb9c98", "37c9c164", "2824a5f6", "1adce6ef",
        "8ba8b39a", "891b62e7", "e5ba7672", "f54016b9", "21ddcdc9", "b1252a9d", "07b5194c", "",
        "3a171ecb", "c5c50484", "e8b83407"]


def _line(label, ints, cats=CATS):
    return "\t".join([str(label)] + [str(v) for v in ints] + cats)


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_criteo_parses_values_and_empty_fields(tmp_path):
    ints = [1, "", -2, 10] + [""] * 9
    rows = tuple(range(1000, 1026))
    path = _write(tmp_path / "day.tsv", [_line(1, ints), _line(0, [0] * 13, [""] * 26)])
    data = CriteoTSV(path, rows, batch_size=4)
    assert len(data) == 1 and data.num_samples == 2
    (dense, sparse), labels = data.batch(0)
    assert dense.dtype == torch.float32 and sparse.dtype == torch.int64
    assert dense.shape == (2, 13) and sparse.shape == (2, 26)
    assert labels.tolist() == [1.0, 0.0]
    expected_dense = [math.log(2), 0.0, 0.0, math.log(11)] + [0.0] * 9
    torch.testing.assert_close(dense[0], torch.tensor(expected_dense, dtype=torch.float32))
    expected_ids = [int(c, 16) % r if c else 0 for c, r in zip(CATS, rows)]
    assert sparse[0].tolist() == expected_ids
    assert sparse[1].tolist() == [0] * 26


def test_criteo_batches_split_the_file_in_order(tmp_path):
    lines = [_line(i % 2, [i] * 13, [format(i * 977 + t, "x") for t in range(26)])
             for i in range(7)]
    path = _write(tmp_path / "day.tsv", lines)
    whole = CriteoTSV(path, (10_000,) * 26, batch_size=7).batch(0)
    data = CriteoTSV(path, (10_000,) * 26, batch_size=3)
    assert len(data) == 3
    parts = [data.batch(i) for i in range(3)]
    assert [p[1].numel() for p in parts] == [3, 3, 1]
    assert torch.equal(torch.cat([p[0][0] for p in parts]), whole[0][0])
    assert torch.equal(torch.cat([p[0][1] for p in parts]), whole[0][1])
    assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
    assert data.batch(2)[0][1][0, 0].item() == 6 * 977
    with pytest.raises(IndexError, match="batch 3 out of range"):
        data.batch(3)


def test_criteo_wrong_field_count_names_file_and_line(tmp_path):
    good = _line(1, [1] * 13)
    path = _write(tmp_path / "bad.tsv", [good, good, good, good, good + "\textra"])
    data = CriteoTSV(path, (100,) * 26, batch_size=2)
    data.batch(0)
    data.batch(1)
    with pytest.raises(ValueError, match=r"bad\.tsv:5: expected 40 tab-separated fields.* got 41"):
        data.batch(2)


def test_criteo_bad_values_name_file_line_and_field(tmp_path):
    path = _write(tmp_path / "v.tsv", [_line(1, [1] * 12 + ["x"])])
    with pytest.raises(ValueError, match=r"v\.tsv:1: field 14 must be an integer"):
        CriteoTSV(path, (100,) * 26, 1).batch(0)
    path = _write(tmp_path / "c.tsv", [_line(1, [1] * 13, ["zz"] + CATS[1:])])
    with pytest.raises(ValueError, match=r"c\.tsv:1: field 15 must be hexadecimal"):
        CriteoTSV(path, (100,) * 26, 1).batch(0)
    path = _write(tmp_path / "l.tsv", [_line(2, [1] * 13)])
    with pytest.raises(ValueError, match=r"l\.tsv:1: label must be 0 or 1"):
        CriteoTSV(path, (100,) * 26, 1).batch(0)


def test_criteo_bad_arguments_are_named(tmp_path):
    path = _write(tmp_path / "d.tsv", [_line(1, [1] * 13)])
    with pytest.raises(ValueError, match="table_rows must have 26"):
        CriteoTSV(path, (100,) * 13, 1)
    with pytest.raises(ValueError, match="batch_size"):
        CriteoTSV(path, (100,) * 26, 0)
