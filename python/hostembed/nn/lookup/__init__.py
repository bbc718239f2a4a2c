"""How the modules look rows up, one path a file; Embedding.forward and
EmbeddingBag.forward pick one.

  cpu.py         the core's threads gather rows into host memory (outputs
                 on another device get one copy)
  gpu.py         outputs on a GPU, rows read from pinned host memory
  cached.py      through a row cache (Embedding(cache_rows=N))
  prefetch.py    Embedding.prefetch: the next lookup's rows gathered ahead
  bag_input.py   EmbeddingBag's input forms, checked and brought to one
  bag_cpu.py     EmbeddingBag's CPU path (sum and mean), each distinct row
                 read once and the gradient reduced from the bags'
"""
