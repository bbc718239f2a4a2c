"""Files: tables read from .npy, .safetensors and torch.save files, rows
moved in bounded chunks, the checks run before a load changes anything, and
crash-safe checkpoints of a whole training state.

  files.py       finding a 2-D table inside a file, from its header or
                 archive directory, without reading the rows
  stream.py      moving a whole table in chunks (read_rows from a file,
                 copy_rows from a tensor), so a load never holds it twice;
                 progress bars
  validate.py    the metadata checks of a load (state dicts, optimizer
                 layouts, hyperparameters, steps, moments)
  checkpoint.py  hostembed.save and hostembed.load

Adding a file format: a reader in files.py that returns a FileRows (where
the rows are, their dtype and shape); stream.read_rows reads it.
"""
