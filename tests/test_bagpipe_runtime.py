"""Bagpipe's runtime on gloo + TensorPipe: 2 trainers, 2 embedding servers and the Oracle
Cacher give, bit for bit in float64, the tables and dense parameters of synchronous
data-parallel SGD without a cache (computed here in one process), for lookahead 0, 1 and 5 at
two skews, for the LRU and "no cache" policies, and across a checkpoint and resume (all in ONE
spawn); a killed trainer raises a BagpipeError naming it (a second spawn), a peer failure
(``PeerFailureError``) naming that trainer, as does a stalled one within the timeout plus 5 s,
not the Oracle Cacher that waited for it (a third spawn: the second runs while the third's
processes wait for its stopped trainer)."""
import copy
import multiprocessing
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import tidal
from examples.data.clicks import ClickData
from examples.models.recsys import click_loss, deepfm_small, dlrm_small
from tidal.passes.embedding_cache import EmbeddingCache
from tidal.runtime.bagpipe import BagpipeError, RunSpec, load_checkpoint, train, train_many
from tidal.runtime.peer_failures import PeerFailureError

ROWS = (40, 70, 120)
BATCH, ITERS, LR, T = 8, 6, 0.1, 2


class Float64Clicks:
    """ClickData batches with float64 dense features and labels."""

    def __init__(self, **kw):
        self.data = ClickData(4, ROWS, BATCH, **kw)

    def batch(self, i):
        (dense, sparse), y = self.data.batch(i)
        return (dense.double(), sparse), y.double()


def _setup(factory=dlrm_small):
    torch.manual_seed(0)
    model = factory(table_rows=ROWS, dim=4).double()
    data = Float64Clicks(alpha=1.0)
    c = tidal.compile(copy.deepcopy(model), data.batch(0)[0], passes=[EmbeddingCache(lookahead=2)])
    plan = c.plan.get("embedding_cache")
    weights = {t.name: model.get_submodule(t.name).weight.detach().clone() for t in plan.tables}
    return model, (c.graph_module, plan, weights)


class TokenBatches:
    """Seeded token ids (batch-first) and class labels for a Hugging Face classifier."""

    def batch(self, i):
        g = torch.Generator().manual_seed(100 + i)
        ids = (torch.rand(BATCH, 6, generator=g) ** 3 * 64).long()   # skewed toward low ids
        return (ids,), torch.randint(0, 2, (BATCH,), generator=g)


def _hf_loss(out, y):
    logits = out["logits"] if isinstance(out, dict) else out.logits
    return torch.nn.functional.cross_entropy(logits, y)


def _hf_bert():
    """A tiny transformers BertForSequenceClassification (float64, no dropout) whose word
    embeddings the pass caches (position and token-type embeddings stay in the model)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).double()
    data = TokenBatches()
    c = tidal.compile(copy.deepcopy(model), data.batch(0)[0], passes=[EmbeddingCache()])
    plan = c.plan.get("embedding_cache")
    assert [t.name for t in plan.tables] == ["bert.embeddings.word_embeddings"]
    weights = {t.name: model.get_submodule(t.name).weight.detach().clone() for t in plan.tables}
    return model, (c.graph_module, plan, weights), data


def _reference(model, data, iterations, loss_fn=click_loss):
    """Synchronous data-parallel SGD over T shards without a cache: states after each step
    (on one thread, as the trainers run: no kernel may split a reduction differently)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_steps(copy.deepcopy(model), data, iterations, loss_fn)
    finally:
        torch.set_num_threads(threads)


def _reference_steps(model, data, iterations, loss_fn):
    states = []
    for x in range(iterations):
        inputs, y = data.batch(x)
        n, total = inputs[0].shape[0] // T, None
        for r in range(T):
            model.zero_grad(set_to_none=True)
            s = slice(r * n, (r + 1) * n)
            loss_fn(model(*(t[s] for t in inputs)), y[s]).backward()
            g = [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                 for p in model.parameters()]
            total = g if total is None else [a + b for a, b in zip(total, g)]
        with torch.no_grad():
            for p, g in zip(model.parameters(), total):
                p.add_(g / T, alpha=-LR)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def _assert_equal(tables, dense, state, what):
    for name, w in tables.items():
        assert torch.equal(w, state[f"{name}.weight"]), f"{what}: table {name} differs"
    for k, v in dense.items():
        if k in state:
            assert torch.equal(v, state[k]), f"{what}: dense {k} differs"
    assert any(k in state for k in dense), what


def test_equivalence_policies_checkpoint_resume(tmp_path):
    model, compiled = _setup()
    skews = {"alpha0.5": Float64Clicks(alpha=0.5), "hot0.9": Float64Clicks(
        hot_fraction=0.05, hot_share=0.9)}
    specs, names = [], []
    for skew, data in skews.items():
        for L in (0, 1, 5):
            specs.append(RunSpec(compiled, data, ITERS, lookahead=L, lr=LR, loss_fn=click_loss))
            names.append((skew, f"bagpipe L={L}"))
    data = skews["hot0.9"]
    specs.append(RunSpec(compiled, data, ITERS, policy="lru", lru_rows=12, lr=LR,
                         loss_fn=click_loss))
    names.append(("hot0.9", "lru"))
    specs.append(RunSpec(compiled, data, ITERS, policy="none", lr=LR, loss_fn=click_loss))
    names.append(("hot0.9", "none"))
    ck = str(tmp_path / "ck")
    specs.append(RunSpec(compiled, data, ITERS, lookahead=3, lr=LR, loss_fn=click_loss,
                         checkpoint_every=4, checkpoint_dir=ck))
    names.append(("hot0.9", "checkpointed"))
    specs.append(RunSpec(compiled, data, ITERS, lookahead=3, lr=LR, loss_fn=click_loss,
                         resume=ck))
    names.append(("hot0.9", "resumed"))
    fm, fm_compiled = _setup(deepfm_small)
    specs.append(RunSpec(fm_compiled, skews["alpha0.5"], 4, lookahead=2, lr=LR,
                         loss_fn=click_loss))
    bert, bert_compiled, bert_data = _hf_bert()
    specs.append(RunSpec(bert_compiled, bert_data, 3, lookahead=2, lr=LR, loss_fn=_hf_loss))
    results = train_many(specs, trainers=T, servers=2, timeout_s=60)
    hf, deep_fm = results.pop(), results.pop()
    _assert_equal(hf.tables, hf.dense, _reference(bert, bert_data, 3, _hf_loss)[-1],
                  "transformers BertForSequenceClassification")
    assert len(deep_fm.tables) == 2 * len(ROWS)     # tables.t and the 1-wide linear.t
    _assert_equal(deep_fm.tables, deep_fm.dense, _reference(fm, skews["alpha0.5"], 4)[-1],
                  "DeepFM (nn.Embedding, 1-wide linear tables)")
    refs = {skew: _reference(model, d, ITERS) for skew, d in skews.items()}
    for (skew, what), res in zip(names, results):
        _assert_equal(res.tables, res.dense, refs[skew][-1], f"{skew} {what}")
    by = dict(zip(names, results))
    assert len(by[("hot0.9", "resumed")].stats) == ITERS - 4   # it did resume at iteration 4
    assert load_checkpoint(ck)["next"] == 4
    deep = by[("hot0.9", "bagpipe L=5")].stats
    assert sum(s.hits for s in deep) > 0 and sum(s.rows_synced_background for s in deep) > 0
    none = by[("hot0.9", "none")].stats
    assert all(s.hits == 0 and s.rows_synced_background == 0 for s in none)
    assert sum(s.bytes_critical for s in deep) < sum(s.bytes_critical for s in none)
    assert all(s.hits == 0 for s in by[("hot0.9", "bagpipe L=0")].stats)


class StampedLoss:
    """``click_loss`` that records when each trainer last computed a loss (file ``loss<rank>``
    of ``folder``, rank in the trainers' group)."""

    def __init__(self, folder):
        self.folder = str(folder)

    def __call__(self, out, y):
        import torch.distributed as dist
        # written whole or not at all: the stall (SIGSTOP) may come in the middle of a write
        stamp = Path(self.folder, f"loss{dist.get_rank()}")
        stamp.with_suffix(".tmp").write_text(repr(time.time()))
        os.replace(stamp.with_suffix(".tmp"), stamp)
        return click_loss(out, y)


STALL_TIMEOUT_S = 12.0
QUIET_S = 1.0
"""The stalled run's trainer 1 counts as stopped once its last loss is this old (its
iterations are milliseconds apart): the killed run then starts."""


def _raised(action):
    """The exception ``action()`` raised (``None`` if it returned)."""
    try:
        action()
    except Exception as e:  # noqa: BLE001 - the tests check what it is
        return e
    return None


def _killed_run(model, compiled, checkpoint_dir):
    """Trainer 1 dies at iteration 3, a checkpoint every 2 iterations: (what the run raised, the
    processes it left, the model, the data)."""
    data = Float64Clicks(hot_fraction=0.05, hot_share=0.9)
    error = _raised(lambda: train(
        compiled, data, ITERS, trainers=T, servers=1, lookahead=2, lr=LR, loss_fn=click_loss,
        checkpoint_every=2, checkpoint_dir=checkpoint_dir, timeout_s=90, fail_at=(1, 3)))
    return error, multiprocessing.active_children(), model, data


def _stalled_run(compiled, folder):
    """Trainer 1 stops (SIGSTOP, alive) at the start of iteration 2: (what the run raised, the
    seconds from trainer 1's last loss to then, the processes then alive)."""
    data = Float64Clicks(hot_fraction=0.05, hot_share=0.9)
    error = _raised(lambda: train(
        compiled, data, ITERS, trainers=T, servers=1, lookahead=2, lr=LR,
        loss_fn=StampedLoss(folder), timeout_s=STALL_TIMEOUT_S, fail_at=(1, 2, "stall"),
        progress=False))
    waited = time.time() - float((folder / "loss1").read_text())
    return error, waited, multiprocessing.active_children()


def _stopped_processes(folder, stalled):
    """The stalled run's processes, once its trainer 1's last loss is :data:`QUIET_S` old
    (none if the run ended first)."""
    while not stalled.done():
        try:
            if time.time() - float((folder / "loss1").read_text()) >= QUIET_S:
                return {p.pid for p in multiprocessing.active_children()}
        except (OSError, ValueError):   # not written yet
            pass
        time.sleep(0.05)
    return set()


def _collected(request, name):
    """Whether this session runs the test ``name`` of this module."""
    return any(getattr(item, "module", None) is request.module
               and getattr(item, "originalname", None) == name for item in request.session.items)


@pytest.fixture(scope="module")
def fault_runs(request, tmp_path_factory):
    """The killed and the stalled trainer's runs (those a collected test reads), the killed one
    in the 12 s the stalled one's processes wait for its stopped trainer 1 (2 spawns in the time
    of one): {"killed": (error, processes left, model, data, checkpoint dir), "stalled":
    (error, seconds waited, processes left)}, each run's processes told apart by pid."""
    folder = tmp_path_factory.mktemp("bagpipe_faults")
    stall = _collected(request, "test_stalled_trainer_is_named_not_the_oracle_cacher")
    kill = _collected(request, "test_killed_trainer_raises_and_leaves_checkpoint")
    # both compiled here, before any run starts: one thread seeds and compiles at a time
    stall_compiled, kill_setup = _setup()[1] if stall else None, _setup() if kill else None
    runs = {}
    with ThreadPoolExecutor(1) as pool:
        stalled = pool.submit(_stalled_run, stall_compiled, folder) if stall else None
        stalled_pids = _stopped_processes(folder, stalled) if stall else set()
        if kill:
            ck = str(folder / "ck")
            error, alive, model, data = _killed_run(*kill_setup, ck)
            runs["killed"] = (error, [p for p in alive if p.pid not in stalled_pids], model,
                              data, ck)
        if stall:
            error, waited, alive = stalled.result()
            runs["stalled"] = (error, waited, [p for p in alive if p.pid in stalled_pids
                                               or not stalled_pids])
    return runs


def test_killed_trainer_raises_and_leaves_checkpoint(fault_runs):
    error, left, model, data, ck = fault_runs["killed"]
    if not isinstance(error, BagpipeError):
        raise AssertionError(f"expected a BagpipeError, got {error!r}") from error
    assert "trainer 1 died at iteration 3" in str(error), str(error)
    assert error.trainer == 1 and error.iteration == 3 and error.checkpoint == ck
    assert ck in str(error)
    assert isinstance(error, PeerFailureError) and error.pass_name == "bagpipe"
    assert error.peer == 1 and error.peer_name == "trainer 1", str(error)
    assert str(error).startswith("bagpipe: trainer 1 died"), str(error)
    assert not left, left
    saved = load_checkpoint(ck)
    assert saved["next"] == 2
    _assert_equal(saved["tables"], saved["dense"], _reference(model, data, 2)[-1],
                  "checkpoint at 2")


@pytest.mark.slow
def test_stalled_trainer_is_named_not_the_oracle_cacher(fault_runs):
    """Trainer 1 stops (SIGSTOP, alive) at the start of iteration 2: trainer 0's all-reduce and
    the Oracle Cacher's wait time out; the error names trainer 1 as stalled, within the timeout
    plus 5 s of its last loss (before the stall), and no process is left behind."""
    e, waited, left = fault_runs["stalled"]
    if not isinstance(e, PeerFailureError):
        raise AssertionError(f"expected a PeerFailureError, got {e!r}") from e
    message = str(e)
    assert isinstance(e, BagpipeError) and e.pass_name == "bagpipe", message
    assert e.peer == 1 and e.peer_name == "trainer 1" and e.trainer == 1, message
    assert message.startswith("bagpipe: trainer 1 stalled at iteration 2"), message
    assert "oracle cacher died" not in message and e.timeout_s == STALL_TIMEOUT_S, message
    assert e.what and e.__cause__ is not None, message   # the collective or RPC, and its error
    assert waited < STALL_TIMEOUT_S + 5, (waited, message)
    assert not left, left


def test_the_process_at_fault_is_named_from_the_reports(tmp_path):
    """Without a spawn: a killed embedding server or Oracle Cacher is named as such (a peer
    failure: the trainers' reports chained), a process whose own error came first is named
    with that error (not a peer failure), and nothing to tell gives None."""
    from tidal.runtime.bagpipe.faults import process_failure, read_reports, run_failure, \
        write_report
    gloo = RuntimeError("Connection closed by peer [127.0.0.1]:5")
    write_report(str(tmp_path), 1, T, process_failure(
        "trainer 0 waited", what="the fetch of rows of t for batch 3",
        peer_name="embedding server 0", timeout_s=9.0, exc=gloo))
    reports = read_reports(str(tmp_path))
    server = run_failure([None, None, None, -9], reports, [3, 3], 9.0, None)
    assert isinstance(server, PeerFailureError) and server.peer_name == "embedding server 0"
    assert server.peer is None and server.what == "the fetch of rows of t for batch 3"
    assert str(server).startswith("bagpipe: embedding server 0 died (killed by SIGKILL; "
                                  "trainer 0: the fetch of rows of t"), str(server)
    assert "Connection closed by peer" in str(server.__cause__.__cause__)
    oracle = run_failure([1, None, None, None], reports, [3, 3], 9.0, "ck")
    assert oracle.peer_name == "oracle cacher" and "oracle cacher died" in str(oracle)
    assert oracle.checkpoint == "ck"
    write_report(str(tmp_path), 2, T, ValueError("bad loss"))   # after trainer 0's report
    first = run_failure([None] * 4, read_reports(str(tmp_path)), [3, 3], 9.0, None)
    assert first.peer_name == "embedding server 0", str(first)   # the first report tells
    assert str(first).startswith("bagpipe: embedding server 0 stalled"), str(first)
    (tmp_path / "error1.json").unlink()   # now trainer 1's own error is the first report
    own = run_failure([None] * 4, read_reports(str(tmp_path)), [3, 2], 9.0, None)
    assert type(own) is BagpipeError and own.trainer == 1 and own.iteration == 2
    assert str(own).startswith("bagpipe: trainer 1 failed at iteration 2 (ValueError: bad "
                               "loss)"), str(own)
    assert run_failure([None] * 4, {}, [3, 3], 9.0, None) is None


def test_bad_policy_is_a_clear_error():
    with pytest.raises(BagpipeError, match="policy"):
        train((None, None, None), None, 2, policy="fifo")


def test_compiled_bagpipe_needs_the_embedding_cache_plan():
    c = tidal.compile(dlrm_small(), ClickData(4, (100,) * 8, 4).batch(0)[0])
    with pytest.raises(ValueError, match="no embedding_cache plan"):
        c.bagpipe(None, 2)


def test_flattened_ids_with_offsets_are_refused_not_split_wrong():
    from tidal.runtime.bagpipe.launch import _same_batch
    ids, offsets = torch.arange(10), torch.tensor([0, 3, 7, 9])
    with pytest.raises(BagpipeError, match=r"batch 2: .*dim-0 sizes \[10, 4, 4\]"):
        _same_batch((ids, offsets), torch.zeros(4), 2)
    _same_batch((torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.long)), torch.zeros(4), 0)


def test_progress_line_names_the_run_and_the_slowest_trainer(tmp_path, capsys):
    from tidal.runtime.bagpipe.launch import _report
    specs = [RunSpec(None, None, 10), RunSpec(None, None, 30)]
    for k, marks in enumerate([("10", "10"), ("7", "5")]):
        (tmp_path / f"run{k}").mkdir()
        for r, x in enumerate(marks):
            (tmp_path / f"run{k}" / f"trainer{r}").write_text(x)
    (tmp_path / "result0.pt").write_text("")   # run 0 is finished
    _report(specs, 2, str(tmp_path), started=0.0)
    assert "tidal bagpipe: run 2 of 2, iteration 5 of 30" in capsys.readouterr().err
