"""Hugging Face transformers' own model classes (small configs, random
init, nothing downloaded) with hostembed tables, against the same models
with torch's nn.Embedding: after replace_embeddings and after the plain
swap, tied (GPT-2, Llama, BERT) and untied (Llama); resize_token_embeddings;
Trainer with gradient clipping. The test extra installs transformers
(`pip install '.[test]'`); CI fails if this module skips."""
import tempfile
import warnings

import pytest
import torch

import hostembed

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                   "'.[test]')")
transformers.logging.set_verbosity_error()

VOCAB = 300


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def llama(tie):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tie))


def bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


MODELS = {"gpt2": gpt2, "llama_tied": lambda: llama(True), "llama_untied": lambda: llama(False), "bert": bert}


def build(name, how):
    """The model with torch's tables ("torch"), swapped after it is built
    ("replace") or before ("swap")."""
    torch.manual_seed(0)
    if how == "swap":
        saved = torch.nn.Embedding
        torch.nn.Embedding = hostembed.Embedding
        try:
            model = MODELS[name]()
        finally:
            torch.nn.Embedding = saved
    else:
        model = MODELS[name]()
        if how == "replace":
            hostembed.replace_embeddings(model)
    return model


def train(model, optimizer, steps=3, vocab=VOCAB):
    opt = optimizer(model.parameters())
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 8), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def embeddings(model):
    return model.get_input_embeddings().weight.detach()


@pytest.mark.parametrize("how", ["replace", "swap"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_trains_as_torchs_model_and_keeps_the_tie(name, how):
    reference, model = build(name, "torch"), build(name, how)
    assert isinstance(model.get_input_embeddings(), hostembed.Embedding)
    tied = name != "llama_untied"
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    # Within float32 rounding: a tied table's gradient sums the lookup's
    # rows and the projection's in another order than torch's dense one.
    for optimizer in (lambda p: torch.optim.AdamW(p, lr=1e-2), lambda p: torch.optim.SGD(p, lr=0.1)):
        ours, theirs = train(model, optimizer), train(reference, optimizer)
        assert ours == pytest.approx(theirs, rel=1e-5)
        torch.testing.assert_close(embeddings(model), embeddings(reference), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mean_resizing", [True, False])
@pytest.mark.parametrize("rows", [VOCAB + 13, VOCAB - 40])
@pytest.mark.parametrize("name", ["gpt2", "llama_untied"])
def test_resize_token_embeddings_then_trains_as_torchs(name, rows, mean_resizing):
    reference, model = build(name, "torch"), build(name, "swap")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mean_resizing's note on the new rows' distribution
        for m in (reference, model):
            torch.manual_seed(2)
            m.resize_token_embeddings(rows, mean_resizing=mean_resizing)
    emb = model.get_input_embeddings()
    assert isinstance(emb, hostembed.Embedding) and emb.weight.shape == (rows, 16)
    torch.testing.assert_close(embeddings(model), embeddings(reference), rtol=0, atol=0)
    assert (model.get_output_embeddings().weight is emb.weight) == (name == "gpt2")
    ours = train(model, lambda p: torch.optim.AdamW(p, lr=1e-2), vocab=min(rows, VOCAB))
    theirs = train(reference, lambda p: torch.optim.AdamW(p, lr=1e-2), vocab=min(rows, VOCAB))
    assert ours == pytest.approx(theirs, rel=1e-5)
    torch.testing.assert_close(embeddings(model), embeddings(reference), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gpt2", "llama_untied"])
def test_gradient_checkpointing_trains_as_torchs(name):
    reference, model = build(name, "torch"), build(name, "swap")
    for m in (reference, model):
        m.gradient_checkpointing_enable()
        m.train()
    ours = train(model, lambda p: torch.optim.AdamW(p, lr=1e-2))
    theirs = train(reference, lambda p: torch.optim.AdamW(p, lr=1e-2))
    assert ours == pytest.approx(theirs, rel=1e-5)
    torch.testing.assert_close(embeddings(model), embeddings(reference), rtol=1e-5, atol=1e-6)


def test_set_input_embeddings_then_tie_weights_ties_the_new_host_table():
    """A new table set with set_input_embeddings, and tie_weights() tying
    the output projection to it: a hostembed table as torch's would be."""
    reference, model = build("gpt2", "torch"), build("gpt2", "replace")
    torch.manual_seed(5)
    new_reference = torch.nn.Embedding(VOCAB, 16)
    torch.manual_seed(5)
    new = hostembed.Embedding(VOCAB, 16)
    assert torch.equal(new.weight, new_reference.weight)
    for m, emb in ((reference, new_reference), (model, new)):
        m.set_input_embeddings(emb)
        m.tie_weights()
    assert model.get_input_embeddings() is new
    assert model.get_output_embeddings().weight is new.weight
    ours = train(model, lambda p: torch.optim.AdamW(p, lr=1e-2))
    theirs = train(reference, lambda p: torch.optim.AdamW(p, lr=1e-2))
    assert ours == pytest.approx(theirs, rel=1e-5)
    torch.testing.assert_close(embeddings(model), embeddings(reference), rtol=1e-5, atol=1e-6)


def test_a_compiled_model_trains_as_torchs_with_no_graph_break_of_its_own():
    """GPT-2 (its table tied to the output projection) compiled whole, in
    torch.compile's default mode: the graph breaks of torch's own model
    (transformers' logging) and no more, and torch's losses and table."""
    results = {}
    for how in ("torch", "swap"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = build("gpt2", how)
        compiled = torch.compile(model)
        losses = train(compiled, lambda p: torch.optim.AdamW(p, lr=1e-2))
        results[how] = losses, embeddings(model), sum(torch._dynamo.utils.counters["graph_break"].values())
    assert isinstance(model.get_input_embeddings(), hostembed.Embedding)
    assert results["swap"][2] == results["torch"][2]
    assert results["swap"][0] == pytest.approx(results["torch"][0], rel=1e-5)
    torch.testing.assert_close(results["swap"][1], results["torch"][1], rtol=1e-5, atol=1e-6)


class _Data(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.mark.parametrize("name", ["llama_untied", "gpt2"])
def test_trainer_with_gradient_clipping_runs_unchanged(name):
    """Trainer clips (max_grad_norm) with torch's clip_grad_norm_, which
    takes the untied table's row-sparse gradient once hostembed is
    imported; the logged losses and gradient norms are torch's."""
    def run(model):
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(
                output_dir=out, per_device_train_batch_size=4, num_train_epochs=1, max_grad_norm=0.05,
                logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data())
            trainer.train()
            return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]

    theirs, ours = run(build(name, "torch")), run(build(name, "swap"))
    assert len(ours) == 4 and len(theirs) == 4
    # [step][loss, grad_norm]: pytest.approx takes no nested sequences.
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64),
                               rtol=1e-5, atol=0)


def test_save_pretrained_and_from_pretrained_keep_the_rows(tmp_path):
    model = build("gpt2", "replace")
    train(model, lambda p: torch.optim.SGD(p, lr=0.1), steps=1)
    model.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert torch.equal(embeddings(loaded), embeddings(model))
