"""Moving a whole table in bounded chunks, so loading never holds it twice.

Two routes into a host table:
* read_rows: rows stored raw in a file (.npy, .safetensors, a contiguous
  tensor of a torch.save archive) are read with
  pread straight into the table (float32) or into a per-thread chunk buffer
  and converted by torch's copy (float16/bfloat16/float64). Nothing of the
  file is mapped, so the process's RSS grows by the table alone; the reads go
  through the page cache, which the kernel can reclaim at will.
* copy_rows: from a tensor (a torch.load(mmap=True) result, another module's
  weight, a GPU tensor), chunk by chunk. When the source is a file mapping,
  its pages are handed back after each chunk with MADV_PAGEOUT: a mapped page
  counts in RSS until unmapped, so copying a 40 GB mmap-loaded tensor would
  otherwise peak at 2x. PAGEOUT never loses data (a page the caller modified
  is written to swap or kept, never reverted), unlike MADV_DONTNEED.
"""
import ctypes
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from .._core.ops import common as common_ops

CHUNK_BYTES = 16 << 20
PROGRESS_MIN_BYTES = 1 << 30
LOG_PROGRESS_SECONDS = 5.0  # off a terminal, at most one progress line per this many seconds (and per 10%)
_PAGE = os.sysconf("SC_PAGE_SIZE")
_MADV_DONTNEED = 4
_MADV_PAGEOUT = 21  # Linux >= 5.4; older kernels answer EINVAL and the pages simply stay mapped
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def progress_bar(total_bytes, progress, desc):
    """A tqdm bar over bytes. progress=None shows it for big copies on a
    terminal; progress=True off a terminal (a log file, a pipe) prints a few
    plain lines instead: one at the start, then at most one per 10% and per
    LOG_PROGRESS_SECONDS, and the final one."""
    from tqdm.auto import tqdm

    if progress is None:
        disable = None if total_bytes >= PROGRESS_MIN_BYTES else True  # None: tqdm hides it off a tty
    else:
        disable = not progress
    options = dict(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=disable)
    stream = sys.stderr
    notebook = any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__)  # a widget: nothing to flood
    if disable is False and stream is not None and not notebook and not _isatty(stream):
        return tqdm(**options, file=_LogLines(stream), leave=True, ascii=True,
                    bar_format="{desc}: {percentage:3.0f}% {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]",
                    miniters=max(1, total_bytes // 10), mininterval=LOG_PROGRESS_SECONDS,
                    # no maximum: tqdm's monitor thread would otherwise drop
                    # miniters to 1 after a 10 s pause, a line per chunk after.
                    maxinterval=float("inf"))
    return tqdm(**options, leave=False)


def _isatty(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _LogLines:
    """A file for tqdm that writes each refresh as a line of its own.

    tqdm redraws its bar in place, '\r' + status + padding, and no option
    makes a refresh end its line: in a log those updates pile up as one long
    line of '\r's. This writes each status as a line instead and drops blank
    writes (a close's bare '\n') and a status that repeats the previous one's
    count (the close's final refresh after one at 100%): the part before the
    last " [" of bar_format above, which holds only the time and the rate.
    """

    def __init__(self, stream):
        self.stream = stream
        self.last = None

    def write(self, text):
        line = text.replace("\r", "").strip()
        count = line.rsplit(" [", 1)[0]
        if line and count != self.last:
            self.last = count
            self.stream.write(line + "\n")

    def flush(self):
        self.stream.flush()


def _advise(address, nbytes, advice):
    """madvise over the whole pages inside [address, address + nbytes)."""
    lo = -(-address // _PAGE) * _PAGE
    hi = (address + nbytes) // _PAGE * _PAGE
    if hi > lo:
        _libc.madvise(lo, hi - lo, advice)  # advisory: a refusal only costs memory


def mapped_file_region(address):
    """(path, offset in the file) of the file mapped at `address` in this
    process, or None (anonymous memory, heap, a deleted file, not found)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    path = fields[5].strip() if len(fields) == 6 else ""
                    if not path.startswith("/") or path.endswith("(deleted)"):
                        return None
                    return path, address - start + int(fields[2], 16)
    except OSError:
        pass
    return None


def _rows_per_chunk(row_bytes):
    return max(1, CHUNK_BYTES // max(1, row_bytes))


def copy_rows(dst, src, *, release_source=False, progress=None, desc="copying rows"):
    """dst[:] = src one row chunk at a time (dtype and device converted by torch).

    dst: a contiguous [N, D] host table; src: any [N, D] tensor.
    Pages of a file-mapped source are released as they are copied.
    release_source=True also drops an anonymous CPU source's pages (they read
    back as zeros): only for a caller that owns the last reference to it.
    """
    if dst.shape != src.shape:
        raise ValueError(f"hostembed: cannot copy a {list(src.shape)} tensor into a {list(dst.shape)} table")
    num_rows = src.shape[0]
    if num_rows == 0 or src.numel() == 0:
        return
    contiguous_cpu = src.device.type == "cpu" and src.is_contiguous()
    advice = None
    if contiguous_cpu:
        if release_source:
            advice = _MADV_DONTNEED
        elif mapped_file_region(src.data_ptr()) is not None:
            advice = _MADV_PAGEOUT
    row_bytes = src.shape[1] * src.element_size()
    step = _rows_per_chunk(row_bytes)
    with torch.no_grad(), progress_bar(num_rows * row_bytes, progress, desc) as bar:
        for start in range(0, num_rows, step):
            stop = min(start + step, num_rows)
            piece = src[start:stop]
            dst[start:stop].copy_(piece)
            if advice is not None:
                _advise(piece.data_ptr(), (stop - start) * row_bytes, advice)
            bar.update((stop - start) * row_bytes)


def _writable_bytes(tensor):
    """A writable memoryview over a contiguous CPU tensor's bytes (no copy)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _pread_exact(fd, view, offset, path):
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise ValueError(f"hostembed: '{path}' ended early: short read at byte {offset + done}")
        done += got


def read_rows(rows, dst, *, progress=None):
    """Fills the [N, D] table dst from rows (a _files.FileRows).

    Chunks are read by a few threads at once (pread drops the GIL, and two
    readers copy out of the page cache faster than one); a file of the
    table's dtype is read straight into the table, other dtypes through one
    chunk buffer per thread. Peak extra memory: threads x CHUNK_BYTES.
    """
    num_rows, dim = rows.shape
    if num_rows == 0 or dim == 0:
        return
    row_bytes = dim * rows.dtype.itemsize
    step = _rows_per_chunk(row_bytes)
    direct = rows.dtype == dst.dtype
    table_bytes = _writable_bytes(dst) if direct else None
    local = threading.local()
    fd = os.open(rows.path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, rows.offset, rows.nbytes, os.POSIX_FADV_SEQUENTIAL)

        def load(start):
            stop = min(start + step, num_rows)
            offset = rows.offset + start * row_bytes
            if direct:
                _pread_exact(fd, table_bytes[start * row_bytes:stop * row_bytes], offset, rows.path)
            else:
                if not hasattr(local, "chunk"):
                    local.chunk = torch.empty(step, dim, dtype=rows.dtype)
                chunk = local.chunk[: stop - start]
                _pread_exact(fd, _writable_bytes(chunk), offset, rows.path)
                dst[start:stop].copy_(chunk)
            return (stop - start) * row_bytes

        workers = max(1, min(4, common_ops.get_num_threads()))
        pool = ThreadPoolExecutor(workers, thread_name_prefix="hostembed-read")
        try:
            with progress_bar(rows.nbytes, progress, f"loading {os.path.basename(rows.path)}") as bar, \
                    torch.no_grad():
                for done in pool.map(load, range(0, num_rows, step)):
                    bar.update(done)
        finally:
            # On an error, the chunks not yet started are dropped, not read.
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        os.close(fd)
