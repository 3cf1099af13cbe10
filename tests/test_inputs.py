"""Inputs given as a dict stay keyword inputs everywhere (compile, Compiled.step, the
tick_tock capture and executor); inputs whose dtype cannot fit the model are named; leaf
module paths that name nothing are errors; ``passes="auto"`` keeps the training step and says
what it skipped."""
import copy

import pytest
import torch
import transformers

import tidal
from tidal.passes.tick_tock import TickTock

SGD = dict(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(2, 3)

    def forward(self, x, z, scale=None):
        out = self.a(x) - self.b(z)
        return out if scale is None else out * scale


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _eager_step(model, kwargs, targets, loss_fn, lr=0.5):
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    loss = loss_fn(ref(**kwargs), targets)
    loss.backward()
    opt.step()
    return float(loss.detach()), dict(ref.named_parameters())


def test_a_dict_in_any_order_binds_by_name_in_compile_call_and_step():
    torch.manual_seed(0)
    model = TwoInputs()
    inputs = {"z": torch.randn(4, 2), "x": torch.randn(4, 4)}  # not the signature's order
    y = torch.randn(4, 3)
    want_loss, want = _eager_step(model, inputs, y, _mse)
    c = tidal.compile(model, inputs, loss_fn=_mse, **SGD)
    torch.testing.assert_close(c(**inputs), model(**inputs), rtol=1e-6, atol=1e-6)
    loss = c.step(inputs, y)
    assert float(loss) == pytest.approx(want_loss, rel=1e-6)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p, want[k], rtol=1e-6, atol=1e-6, msg=k)


def test_an_unknown_or_missing_keyword_is_named():
    model = TwoInputs()
    c = tidal.compile(model, {"x": torch.randn(4, 4), "z": torch.randn(4, 2)}, loss_fn=_mse, **SGD)
    with pytest.raises(ValueError, match="'w' is not an input of the traced model"):
        c.step({"x": torch.randn(4, 4), "w": torch.randn(4, 2)}, torch.randn(4, 3))
    with pytest.raises(ValueError, match="input 'z' is missing"):
        c.step({"x": torch.randn(4, 4)}, torch.randn(4, 3))


def _t5():
    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                num_heads=2, decoder_start_token_id=0, dropout_rate=0.0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg).eval()


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                  attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _lm_loss(out, y):
    return torch.nn.functional.cross_entropy(out["logits"].flatten(0, 1), y.flatten())


def test_t5_step_takes_decoder_input_ids_by_name():
    """Before, the dict became one positional input; T5's ``decoder_input_ids`` would land in
    ``attention_mask``."""
    model = _t5()
    g = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, 64, (2, 5), generator=g),
              "decoder_input_ids": torch.randint(0, 64, (2, 3), generator=g)}
    y = torch.randint(0, 64, (2, 3), generator=g)
    want_loss, want = _eager_step(model, inputs, y, _lm_loss)
    c = tidal.compile(model, inputs, loss_fn=_lm_loss, **SGD)
    assert float(c.step(inputs, y)) == pytest.approx(want_loss, rel=1e-5)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p, want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_tick_tock_keeps_the_attention_mask_a_keyword_input():
    """Before, tick_tock captured its step calling the model positionally, so the mask landed
    in GPT-2's ``past_key_values``, and ``Compiled.step(dict, y)`` failed inside torch."""
    model = _gpt2()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (4, 6), generator=g)
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[:, :2] = 0  # left padding: the mask changes the loss
    inputs = {"input_ids": ids, "attention_mask": mask}
    y = torch.randint(0, 64, (4, 6), generator=g)
    with torch.no_grad():  # both waves start from the same parameters: the mean of the halves
        halves = [{k: v[i * 2:(i + 1) * 2] for k, v in inputs.items()} for i in range(2)]
        want = sum(float(_lm_loss(model(**h), y[i * 2:(i + 1) * 2]))
                   for i, h in enumerate(halves)) / 2
        unmasked = sum(float(_lm_loss(model(input_ids=h["input_ids"]), y[i * 2:(i + 1) * 2]))
                       for i, h in enumerate(halves)) / 2
    assert abs(want - unmasked) > 1e-4  # the mask matters for this batch
    c = tidal.compile(model, inputs, passes=[TickTock(ranks=1)], example_targets=y,
                      loss_fn=_lm_loss, **SGD)
    assert c.plan.get("tick_tock").peak_bytes > 0  # the step was captured (memory timeline)
    assert float(c.step(inputs, y)) == pytest.approx(want, rel=1e-6, abs=1e-6)


# -- dtypes and leaf modules -----------------------------------------------------------------
def test_an_integer_input_to_a_float_conv_is_named():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    with pytest.raises(ValueError, match=r"input 'input' is torch.int64, but its first consumer "
                                         r"'0' \(Conv2d\) computes in torch.float32"):
        tidal.compile(model, torch.zeros(2, 3, 8, 8, dtype=torch.long))


def test_a_float_input_to_an_embedding_is_named():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'0' \(Embedding\) takes integer indices"):
        tidal.compile(model, torch.zeros(2, 5))


def test_an_unknown_leaf_module_path_is_an_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(tidal.TraceError, match="has no module 'no.such.module'"):
        tidal.compile(model, torch.randn(2, 4), leaf_modules=["no.such.module"])
    with pytest.raises(tidal.TraceError, match="has no module 'transformer.h.9'"):
        tidal.compile(_gpt2(), {"input_ids": torch.zeros(1, 4, dtype=torch.long)},
                      leaf_modules=["transformer.h.9"])


def test_leaf_modules_keep_a_hugging_face_block_whole():
    model = _gpt2()
    inputs = {"input_ids": torch.randint(0, 64, (2, 6))}
    gm = tidal.trace(model, inputs, leaf_modules=["transformer.h.0"])
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert "transformer.h.0" in calls
    with torch.no_grad():
        torch.testing.assert_close(gm(**inputs)["logits"], model(**inputs).logits,
                                   rtol=1e-5, atol=1e-5)


# -- auto -----------------------------------------------------------------------------------
def test_auto_never_selects_a_pass_that_changes_the_update_and_says_why():
    """Before, ``auto`` picked tick_tock in one process: its update is not an SGD step."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    c = tidal.compile(model, torch.randn(8, 4), passes="auto",
                      loss_fn=torch.nn.functional.cross_entropy, **SGD)
    ran = [r.name for r in c.records]
    assert "tick_tock" not in ran and "compression" not in ran
    report = c.report()
    assert "skipped tick_tock: its update is not the SGD step" in report
    assert "skipped compression" in report and "skipped round_robin" in report
    named = tidal.compile(model, torch.randn(8, 4), passes=["tick_tock"],
                          loss_fn=torch.nn.functional.cross_entropy, **SGD)
    assert "tick_tock" in [r.name for r in named.records]


def test_lowering_binds_a_dict_by_name():
    from tidal.runtime.lower import lower

    torch.manual_seed(0)
    model = TwoInputs()
    inputs = {"z": torch.randn(4, 2), "x": torch.randn(4, 4)}  # not the signature's order
    gm = tidal.trace(model, inputs)
    lowered = lower(gm, inputs)
    torch.testing.assert_close(lowered(**inputs), model(**inputs), rtol=1e-6, atol=1e-6)
