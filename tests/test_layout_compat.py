"""Files written by hostembed before its package was split into layers
(tests/fixtures/before_layout/, made at commit f147831) still load: a
hostembed.save checkpoint resumes training to the same bits, and modules
pickled by torch.save and by pickle come back with their rows and train.

The state the files hold is compared bit for bit: loading copies it. A step
trained from it is compared bit for bit with the same step from the same
state, loaded through plain load_state_dict, in this run on this CPU; the
fixture's own step, made on another CPU, only to a tolerance: the model's
nn.Linear runs torch's BLAS, which rounds differently from one CPU to
another (its weight by ~5e-7 and so the tables' gradients by ~1e-8), while
a lost or misread optimizer state moves the tables' rows by ~1e-2."""
import importlib.util
import os
import pickle

import pytest
import torch

import hostembed

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "before_layout")


def _maker():
    spec = importlib.util.spec_from_file_location("before_layout_make", os.path.join(FIXTURES, "make.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _expected():
    return torch.load(os.path.join(FIXTURES, "expected.pt"), weights_only=True)


def _assert_state(model, state):
    got = model.state_dict()
    assert sorted(got) == sorted(state)
    for key, value in state.items():
        assert torch.equal(got[key], value), key


def _saved_optimizer_states():
    return torch.load(os.path.join(FIXTURES, "checkpoint.pt"), weights_only=True)["optimizer"]


def _load_optimizer_states(optimizers):
    for opt, state in zip(optimizers, _saved_optimizer_states()):
        opt.load_state_dict(state)


def _reference_step(make, expected):
    """The fourth step from the saved state, by a model made now whose rows
    and optimizer states are loaded with load_state_dict."""
    model = make.make_model()
    model.load_state_dict(expected["state_dict"])
    optimizers = make.make_optimizers(model)
    _load_optimizer_states(optimizers)
    make.train_step(model, optimizers, 3)
    return model.state_dict()


def _assert_near_fixture(model, expected):
    got = model.state_dict()
    for key, value in expected["after_step"].items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def _assert_step(model, make, expected):
    _assert_state(model, _reference_step(make, expected))
    _assert_near_fixture(model, expected)


def test_a_checkpoint_resumes_to_the_same_bits():
    make, expected = _maker(), _expected()
    torch.manual_seed(1)  # other initial rows: the load must replace them all
    model = make.make_model()
    optimizers = make.make_optimizers(model)
    extra = hostembed.load(os.path.join(FIXTURES, "checkpoint.pt"), model, optimizers)
    assert extra == {"step": 3}
    _assert_state(model, expected["state_dict"])
    make.train_step(model, optimizers, 3)  # needs the optimizer state as it was saved
    _assert_step(model, make, expected)


def _check_unpickled(model, make, expected):
    assert isinstance(model["words"], hostembed.Embedding)
    assert isinstance(model["bags"], hostembed.EmbeddingBag)
    assert model["cached"].cache_rows == 8
    _assert_state(model, expected["state_dict"])
    # It trains: one step from the saved rows, with the optimizer state
    # taken from the checkpoint (a pickle holds none), gives the same bits.
    optimizers = make.make_optimizers(model)
    _load_optimizer_states(optimizers)
    make.train_step(model, optimizers, 3)
    _assert_step(model, make, expected)


def test_a_module_saved_whole_by_torch_save_loads():
    model = torch.load(os.path.join(FIXTURES, "model.pt"), weights_only=False)
    _check_unpickled(model, _maker(), _expected())


def test_a_pickled_module_loads():
    with open(os.path.join(FIXTURES, "model.pkl"), "rb") as f:
        model = pickle.load(f)
    _check_unpickled(model, _maker(), _expected())


def test_the_tolerance_tells_a_lost_optimizer_state():
    """The fixture's step is compared to a tolerance: a resume that lost the
    optimizer state falls outside it."""
    make, expected = _maker(), _expected()
    model = make.make_model()
    model.load_state_dict(expected["state_dict"])
    optimizers = make.make_optimizers(model)  # fresh: no state loaded
    make.train_step(model, optimizers, 3)
    with pytest.raises(AssertionError, match="words.weight"):
        _assert_near_fixture(model, expected)
