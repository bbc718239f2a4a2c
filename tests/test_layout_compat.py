"""Files written by hostembed before its package was split into layers
(tests/fixtures/before_layout/, made at commit f147831) still load: a
hostembed.save checkpoint resumes training to the same bits, and modules
pickled by torch.save and by pickle come back with their rows and train."""
import importlib.util
import os
import pickle

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


def test_a_checkpoint_resumes_to_the_same_bits():
    make, expected = _maker(), _expected()
    torch.manual_seed(1)  # other initial rows: the load must replace them all
    model = make.make_model()
    optimizers = make.make_optimizers(model)
    extra = hostembed.load(os.path.join(FIXTURES, "checkpoint.pt"), model, optimizers)
    assert extra == {"step": 3}
    _assert_state(model, expected["state_dict"])
    make.train_step(model, optimizers, 3)  # needs the optimizer state as it was saved
    _assert_state(model, expected["after_step"])


def _check_unpickled(model, make, expected):
    assert isinstance(model["words"], hostembed.Embedding)
    assert isinstance(model["bags"], hostembed.EmbeddingBag)
    assert model["cached"].cache_rows == 8
    _assert_state(model, expected["state_dict"])
    # It trains: one step from the saved rows, with the optimizer state
    # taken from the checkpoint (a pickle holds none), gives the same bits.
    optimizers = make.make_optimizers(model)
    for opt, state in zip(optimizers, torch.load(os.path.join(FIXTURES, "checkpoint.pt"),
                                                 weights_only=True)["optimizer"]):
        opt.load_state_dict(state)
    make.train_step(model, optimizers, 3)
    _assert_state(model, expected["after_step"])


def test_a_module_saved_whole_by_torch_save_loads():
    model = torch.load(os.path.join(FIXTURES, "model.pt"), weights_only=False)
    _check_unpickled(model, _maker(), _expected())


def test_a_pickled_module_loads():
    with open(os.path.join(FIXTURES, "model.pkl"), "rb") as f:
        model = pickle.load(f)
    _check_unpickled(model, _maker(), _expected())
