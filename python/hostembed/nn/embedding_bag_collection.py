"""hostembed.EmbeddingBagCollection: a model's EmbeddingBag tables looked
up with one call."""
from collections.abc import Sequence

import torch
from torch import nn

from .embedding_bag import EmbeddingBag
from .lookup import bag_cpu as _bag_cpu
from .lookup.cpu import max_norm_of


class EmbeddingBagCollection(nn.ModuleList):
    r"""An :class:`torch.nn.ModuleList` of tables whose forward looks them
    all up at once: ``collection(inputs, offsets, per_sample_weights)``
    returns ``[collection[k](inputs[k], offsets[k], per_sample_weights[k])
    for k in ...]``, the same outputs and gradients, but the
    :class:`hostembed.EmbeddingBag` tables that pool on the CPU (``"sum"``
    or ``"mean"`` without ``max_norm``) are pooled by one call of the core,
    its threads spread over every table's bags. Other modules (``"max"``
    mode, ``max_norm``, outputs read on the GPU, any other module) are
    called one by one, in the same list.

    Each table stays a module of its own: its shape, dtype, options,
    optimizer state, ``state_dict`` keys (``"0.weight"``, ...),
    ``hostembed.save``/``load``, casts and ``.to()`` are as if it were in
    a plain ``nn.ModuleList``, and ``collection[k](...)`` still looks one
    table up. A model written with ``nn.ModuleList([nn.EmbeddingBag(...),
    ...])`` and a loop over it switches by building this instead and
    calling it once::

        self.tables = hostembed.EmbeddingBagCollection(
            [hostembed.EmbeddingBag(n, 64, mode="sum") for n in sizes])
        pooled = self.tables(ids_per_table, offsets_per_table)

    Args:
        modules (iterable of torch.nn.Module, optional): the tables, in
            order (``nn.ModuleList``'s argument): usually
            :class:`hostembed.EmbeddingBag` modules; any other module that
            takes ``(input, offsets, per_sample_weights)`` is called as it
            is. More can be added later (``append``, ``extend``,
            ``insert``), as to any ``nn.ModuleList``. Default: None (none
            yet)
    """

    def forward(self, inputs, offsets=None, per_sample_weights=None):
        """Every table's bags, looked up with one call.

        Args:
            inputs (sequence of Tensor): one input per table (a list or a
                tuple of ``len(self)`` entries), each in any form its table
                takes (1-D with offsets, 2-D, nested).
            offsets (sequence of Tensor, optional): None, or one entry per
                table (an entry may be None), as the table's ``offsets``.
                Default: None
            per_sample_weights (sequence of Tensor, optional): None, or one
                entry per table (an entry may be None), as the table's
                ``per_sample_weights``. Default: None

        Returns:
            list of Tensor: ``[self[k](inputs[k], offsets[k],
            per_sample_weights[k]) for k in range(len(self))]``, each of
            shape ``(B_k, embedding_dim_k)`` for an EmbeddingBag, on that
            table's ``output_device``.

        Raises:
            TypeError: an argument that is not a list or tuple (a tensor
                included) where one entry per table is expected.
            ValueError: a sequence whose length is not the number of
                tables.
        """
        count = len(self)
        inputs = _per_table(inputs, count, "inputs")
        offsets = _per_table(offsets, count, "offsets")
        per_sample_weights = _per_table(per_sample_weights, count, "per_sample_weights")
        outputs = [None] * count
        modules = list(self._modules.values())
        pooled, specs, weights, sample_weights = [], [], [], []
        for k, module in enumerate(modules):
            if not (type(module).forward is EmbeddingBag.forward and module._pools_on_cpu()
                    and max_norm_of(module) is None):
                outputs[k] = module(inputs[k], offsets[k], per_sample_weights[k])
                continue
            ids, offs, psw, last = module._bags(inputs[k], offsets[k], per_sample_weights[k], pools_on_cpu=True)
            module._prepare_weight()
            padding_idx = -1 if module.padding_idx is None else module.padding_idx
            specs.append((ids, offs, last, padding_idx, module.mode == "mean", module.scale_grad_by_freq,
                          module._sparse_gradient(), module._table))
            # The parameter itself: module.weight would check the process
            # and flush a cache again, which _prepare_weight just did.
            weights.append(module._parameters["weight"])
            sample_weights.append(psw)
            pooled.append(k)
        if pooled:
            for k, out in zip(pooled, _bag_cpu.pooled_tables(specs, weights, sample_weights)):
                module = modules[k]
                module._record_path("pooled")
                device = module._output_device
                outputs[k] = out if device.type == "cpu" else out.to(device)
        return outputs

    def _get_name(self):
        return "hostembed.EmbeddingBagCollection"


def _per_table(values, count, name):
    """values as a list of count entries (None: count Nones), or the
    ValueError/TypeError saying what was expected."""
    if values is None:
        return [None] * count
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
        raise TypeError(f"hostembed.EmbeddingBagCollection: {name} must be a list or tuple with one entry per "
                        f"table, got {type(values).__name__}")
    if len(values) != count:
        raise ValueError(f"hostembed.EmbeddingBagCollection: {name} has {len(values)} entries for {count} tables")
    return list(values)
