"""Embedding.prefetch(ids): the next lookup's rows gathered ahead of time.

The gather runs on a Python thread (the core releases the GIL), so it
overlaps whatever the caller does until the lookup of those ids: the rest
of the model's forward and backward, the optimizer step, loading the next
batch. It holds the table's lock like any op, so it never sees half an
update.

Coherence. Rows the table's ops write after the prefetch was asked for (an
optimizer update, fused or not; a max_norm renorm by another lookup; a
load) are noted on it (HostTable.rows_changed); the lookup that takes the
prefetch re-reads those rows from the table, so its output is bit for bit
what a lookup without prefetch would give. A write that cannot say which
rows it changed (a load, a GPU op), or an in-place change of the weight
through torch (its version counter moved), makes the lookup discard the
prefetch and gather anew.

When more than MAX_REREAD of the positions would be re-read (skewed ids:
the next batch's hot rows are the ones this step updates), the lookup
gathers anew instead.

The lookup takes the prefetch only for the same ids (the same tensor, or
equal values, shape and dtype); any other lookup of the table drops it.
An error of the prefetch's gather (an id out of range) is not raised there:
the lookup gathers anew and raises it as usual.
"""
import threading

import torch

# Above this fraction of positions to re-read, the lookup gathers anew: one
# by one, re-reading most rows costs more than the core's gather of all.
MAX_REREAD = 0.25


class Prefetch:
    def __init__(self, table, weight, ids, out, gather):
        """gather() fills out with the rows of ids (_core.ops.cpu.gather_later)."""
        self.table, self.ids = table, ids
        self.version = weight._version
        # Rows changed since: int64 CPU id tensors, or None for "any row".
        self.changed = []
        self.out = None
        self._thread = threading.Thread(target=self._run, args=(out, gather), name="hostembed-prefetch",
                                        daemon=True)
        self._thread.start()

    def _run(self, out, gather):
        try:
            gather()
            self.out = out
        except Exception:  # raised again by the lookup's own gather
            pass

    def take(self, weight, ids):
        """The prefetched rows for `ids`, brought up to date, or None when
        the lookup must gather itself. table.prefetch_outcome says which
        (tests check that the prefetched rows were used)."""
        self._thread.join()
        out, table = self.out, self.table
        reason = ("its gather failed" if out is None else
                  "the weight was changed in place" if weight._version != self.version else
                  "other ids" if not _same_ids(self.ids, ids) else
                  "rows changed by a write that does not say which" if any(r is None for r in self.changed) else
                  None)
        if reason is not None:
            table.prefetch_outcome = f"dropped: {reason}"
            return None
        patched = 0
        if self.changed:
            flat = ids.reshape(-1)
            # A flag per table row (a byte each: 2 MB for 2M rows, cheaper
            # than sorting ids for torch.isin).
            written = torch.zeros(table.num_rows, dtype=torch.bool)
            for rows in self.changed:
                written[rows] = True
            stale = written[flat].nonzero().squeeze(1)
            patched = stale.numel()
            if patched > MAX_REREAD * flat.numel():
                # Skewed ids: the next batch's hot rows are the ones this
                # step updated.
                table.prefetch_outcome = f"dropped: {patched} of {flat.numel()} positions changed"
                return None
            if patched:
                with table.lock:
                    table.wait_for_gpu_use()
                    out.view(-1, table.dim)[stale] = table.tensor[flat[stale]]
        table.prefetch_outcome = f"taken, {patched} of {ids.numel()} positions re-read"
        return out


def _same_ids(a, b):
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
