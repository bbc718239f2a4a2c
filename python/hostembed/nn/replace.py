"""Swapping the big nn.Embedding / nn.EmbeddingBag modules of an existing
model for host tables."""
import warnings

import torch
from torch import nn

from ..io.stream import copy_rows
from .host_module import UNINITIALISED, HostTableModule
from .embedding import Embedding
from .embedding_bag import EmbeddingBag


def replace_embeddings(model, min_rows=0, *, sparse=True, progress=None):
    """Replaces every ``torch.nn.Embedding`` and ``torch.nn.EmbeddingBag``
    in `model` with at least `min_rows` rows by a :class:`hostembed.Embedding`
    or :class:`hostembed.EmbeddingBag` with the same options and weights;
    returns the model (or the replacement, when `model` itself is one).

    Rows move in chunks. A CPU weight that nothing else shares (no views, no
    other tensor on its storage) is released as its rows are copied, so peak
    memory stays about one table; the replaced module is left with an empty
    weight. A weight on the meta device (a model built with
    ``torch.device("meta")``) gives a zero table, ready for
    ``load_state_dict`` or :func:`hostembed.load`, so such a model is filled
    from a checkpoint without ever holding the table twice. A module used in
    several places is replaced by one shared hostembed.Embedding.
    Subclasses of torch's two (other than hostembed's) are not replaced, with
    a warning. Build optimizers after replacing: the old parameters are no
    longer part of the model.

    Args:
        model (torch.nn.Module): the model whose modules are replaced in
            place (or one ``nn.Embedding`` / ``nn.EmbeddingBag`` itself).
        min_rows (int, optional): replace only tables of at least that many
            rows (``num_embeddings``); an int >= 0 (ValueError otherwise).
            Default: ``0`` (every one)
        sparse (bool, optional): keyword-only: True makes each table's
            gradient row-sparse, as ``torch.nn.Embedding =
            hostembed.Embedding`` before the model is built does: torch's
            dense optimizers (Adam, AdamW, ...) still give their dense
            results, without a table-sized gradient (see the
            training-scripts guide). False makes every gradient dense; None
            keeps each module's own ``sparse`` flag (torch's default is
            False: a dense gradient of the whole table every step, with a
            warning). Default: ``True``
        progress (bool, optional): keyword-only: show a tqdm progress bar
            while rows move (None: for tables of 1 GiB and more, on a
            terminal). Default: None

    Returns:
        torch.nn.Module: ``model``, or its replacement when ``model`` itself
        is an ``nn.Embedding`` or ``nn.EmbeddingBag``.
    """
    if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 0:
        raise ValueError(f"replace_embeddings: min_rows must be an int >= 0, got {min_rows!r}")
    # Keyed by the weight: a module used in several places, and modules
    # tied to one weight (T5's shared token table), become one host table.
    replaced = {}

    def convert(module):
        key = id(module.weight)
        if key not in replaced:
            replaced[key] = (module, _to_host(module, sparse, progress))
        first, new = replaced[key]
        if module is not first and _options(module) != _options(first):
            raise ValueError(f"replace_embeddings: two {type(module).__name__} modules share one weight with other "
                             f"options ({_options(first)} and {_options(module)}); one host table cannot serve both")
        return new

    def wants(module):
        return type(module) in (nn.Embedding, nn.EmbeddingBag) and module.num_embeddings >= min_rows

    if wants(model):
        return convert(model)
    weights = {id(module.weight): module.weight for module in model.modules() if wants(module)}
    tied = _tied_elsewhere(model, weights, wants)
    for key, places in tied.items():
        if weights[key].device.type not in ("cpu", "meta"):
            raise ValueError(
                f"replace_embeddings: the {tuple(weights[key].shape)} table on {weights[key].device} is tied to "
                f"{', '.join(places)}; a host table's weight is in host memory, where those modules cannot use it "
                "on the GPU. Untie them first (e.g. tie_word_embeddings=False in a transformers config), or replace "
                "the tables of the model while it is on the CPU")
    skipped = set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if wants(child):
                setattr(parent, name, convert(child))
            elif _skipped_table(child, min_rows):
                skipped.add(type(child))
    # The tie kept: the modules that shared an old weight (a language
    # model's output projection) now share the host table's.
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced and not isinstance(module, HostTableModule):
                module._parameters[name] = replaced[id(param)][1].weight
    for kind in sorted(skipped, key=lambda t: t.__qualname__):
        warnings.warn(
            f"replace_embeddings: {kind.__module__}.{kind.__qualname__} modules are not replaced (only "
            "torch.nn.Embedding and torch.nn.EmbeddingBag are); their tables stay where they are",
            UserWarning,
            stacklevel=2,
        )
    return model


def _options(module):
    keys = ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
            "mode", "include_last_offset")
    return {k: getattr(module, k, None) for k in keys}


def _tied_elsewhere(model, weights, wants):
    """{id of a table's weight: where else the model holds it ('lm_head.weight')}
    for the weights of the tables to replace."""
    places = {}
    for path, module in model.named_modules():
        if wants(module):
            continue
        for name, param in module._parameters.items():
            if param is not None and id(param) in weights:
                places.setdefault(id(param), []).append(f"{path}.{name}" if path else name)
    return places


def _skipped_table(module, min_rows):
    """An embedding-like torch module big enough to replace that this
    function does not convert (subclasses of nn.Embedding or nn.EmbeddingBag
    other than hostembed's own)."""
    if isinstance(module, HostTableModule) or type(module) in (nn.Embedding, nn.EmbeddingBag):
        return False
    if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return False
    return getattr(module, "num_embeddings", 0) >= min_rows


def _to_host(old, sparse, progress):
    weight = old.weight
    device = weight.device if weight.device.type not in ("cpu", "meta") else None
    options = dict(padding_idx=old.padding_idx, max_norm=old.max_norm, norm_type=old.norm_type,
                   scale_grad_by_freq=old.scale_grad_by_freq, sparse=old.sparse if sparse is None else sparse,
                   _weight=UNINITIALISED, _freeze=not weight.requires_grad, device=device, dtype=weight.dtype)
    if isinstance(old, nn.EmbeddingBag):
        new = EmbeddingBag(old.num_embeddings, old.embedding_dim, mode=old.mode,
                           include_last_offset=old.include_last_offset, **options)
    else:
        new = Embedding(old.num_embeddings, old.embedding_dim, **options)
    if weight.device.type == "meta":
        return new
    release = weight.device.type == "cpu" and weight.is_contiguous() and _sole_owner(weight)
    copy_rows(new.weight.data, weight.detach(), release_source=release, progress=progress,
              desc="moving embedding rows")
    if release:
        with torch.no_grad():
            weight.data = torch.empty(0, dtype=weight.dtype)  # its old pages were given back: show it
    return new


def _sole_owner(tensor):
    """True when no other tensor (view, alias) shares tensor's storage.

    The count includes the temporary storage object made to ask, hence 2.
    Without torch's private counter we cannot tell, and keep the source.
    """
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    return use_count(tensor.untyped_storage()._cdata) == 2
