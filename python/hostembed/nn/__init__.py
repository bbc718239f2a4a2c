"""The modules: drop-ins for torch.nn.Embedding and torch.nn.EmbeddingBag
whose table lives in host memory, and what works on them.

  host_module.py    HostTableModule, what Embedding and EmbeddingBag share:
                    the table behind the weight, the output device, copies,
                    pickling, casts, state_dict
  embedding.py      Embedding
  embedding_bag.py  EmbeddingBag
  embedding_bag_collection.py
                    EmbeddingBagCollection: many bag tables, one lookup call
  replace.py        replace_embeddings: an existing model's big embeddings
                    swapped for host tables
  clip.py           clip_grad_norm_ for row-sparse gradients
  lookup/           the lookup paths (CPU, GPU, cached, bags, prefetch)

Adding a table kind (a module): a torch.nn subclass over HostTableModule,
as Embedding is, whose forward picks a path in lookup/; a lookup that must
trace under torch.compile calls the custom ops of _core/ops.
"""
from .clip import clip_grad_norm_
from .embedding import Embedding
from .embedding_bag import EmbeddingBag
from .embedding_bag_collection import EmbeddingBagCollection
from .replace import replace_embeddings

__all__ = ["Embedding", "EmbeddingBag", "EmbeddingBagCollection", "replace_embeddings", "clip_grad_norm_"]
