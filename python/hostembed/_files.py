"""Finding a 2-D table inside a .npy, .safetensors or torch.save file.

For .npy and .safetensors the headers are parsed here (both are a small
header followed by raw little-endian rows), so the rows can then be read
with pread straight into the table, a chunk at a time, never mapping or
buffering the whole file. A torch.save file is a zip archive whose pickle
only torch can interpret safely (weights_only), so it is opened with
torch.load(mmap=True): nothing is read until touched, and the copy releases
the mapped pages as it goes (_stream.copy_rows).
"""
import ast
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ._stream import mapped_file_region

SUPPORTED_SUFFIXES = (".pt", ".pth", ".safetensors", ".npy")

# dtypes a table may be loaded from (the table itself is float32).
_LOADABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_NPY_DTYPES = {"<f4": torch.float32, "<f2": torch.float16, "<f8": torch.float64}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


@dataclass
class FileRows:
    """A C-contiguous 2-D array stored raw at `offset` in the file at `path`."""

    path: str
    offset: int
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize


def open_table(path, key=None):
    """Returns the table named by `key` (or the obvious one) in the file at
    `path`: a FileRows for .npy/.safetensors, a (possibly mmap-backed) CPU
    tensor for torch.save files. Raises before anything is allocated:
    FileNotFoundError, ValueError (unknown suffix, malformed or truncated
    file, not 2-D), KeyError (no such key; lists the keys), TypeError (dtype
    that is not a float type the table can take)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"hostembed: no such file: '{path}'")
    if os.path.isdir(path):
        raise IsADirectoryError(f"hostembed: expected a file, '{path}' is a directory")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        if key is not None:
            raise ValueError(f"hostembed: a .npy file holds one array, so key={key!r} does not apply ('{path}')")
        rows = _npy_rows(path)
    elif suffix == ".safetensors":
        rows = _safetensors_rows(path, key)
    elif suffix in (".pt", ".pth"):
        rows = _torch_file_tensor(path, key)
    else:
        raise ValueError(
            f"hostembed: cannot tell the format of '{path}' from its suffix '{suffix}': expected one of "
            f"{', '.join(SUPPORTED_SUFFIXES)}"
        )
    check_table_like(rows.shape, rows.dtype, where=f"'{path}'" + ("" if key is None else f" key {key!r}"))
    return rows


def check_table_like(shape, dtype, where):
    if len(shape) != 2:
        raise ValueError(f"hostembed: expected a 2-D table in {where}, found shape {list(shape)}")
    if dtype not in _LOADABLE:
        names = ", ".join(str(d).replace("torch.", "") for d in _LOADABLE)
        raise TypeError(f"hostembed: unsupported dtype {dtype} in {where}: expected one of {names}")


def _file_size(path):
    return os.stat(path).st_size


def _check_covered(path, end, what):
    size = _file_size(path)
    if size < end:
        raise ValueError(f"hostembed: '{path}' is truncated: {what} needs {end} bytes, the file has {size}")


def _npy_rows(path):
    with open(path, "rb") as f:
        magic = f.read(8)
        if len(magic) < 8 or magic[:6] != b"\x93NUMPY":
            raise ValueError(f"hostembed: '{path}' is not a .npy file (bad magic bytes)")
        major = magic[6]
        if major == 1:
            (header_len,) = struct.unpack("<H", f.read(2))
            header_start = 10
        elif major in (2, 3):
            (header_len,) = struct.unpack("<I", f.read(4))
            header_start = 12
        else:
            raise ValueError(f"hostembed: '{path}' has .npy format version {major}, expected 1, 2 or 3")
        raw = f.read(header_len)
    if len(raw) < header_len:
        raise ValueError(f"hostembed: '{path}' is truncated inside its .npy header")
    try:
        header = ast.literal_eval(raw.decode("utf-8" if major == 3 else "latin1"))
        descr, fortran, shape = header["descr"], header["fortran_order"], tuple(header["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError) as exc:
        raise ValueError(f"hostembed: '{path}' has a malformed .npy header: {exc}") from None
    if descr not in _NPY_DTYPES:
        raise TypeError(
            f"hostembed: unsupported dtype {descr!r} in '{path}': expected little-endian float16, float32 or "
            "float64 ('<f2', '<f4', '<f8')"
        )
    if fortran and len(shape) == 2 and shape[0] > 1 and shape[1] > 1:
        # Rows would be strided across the whole file: no streaming read.
        raise ValueError(
            f"hostembed: '{path}' stores its array in Fortran (column-major) order; save it row-major "
            "(np.save(path, np.ascontiguousarray(a)))"
        )
    rows = FileRows(path, header_start + header_len, shape, _NPY_DTYPES[descr])
    if len(shape) == 2:
        _check_covered(path, rows.offset + rows.nbytes, f"a {list(shape)} {descr} array")
    return rows


def _safetensors_rows(path, key):
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"hostembed: '{path}' is truncated: no safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > _file_size(path) - 8:
            raise ValueError(
                f"hostembed: '{path}' is truncated or not a safetensors file: its header claims {header_len} bytes"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"hostembed: '{path}' has a malformed safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    shapes = {name: tuple(entry["shape"]) for name, entry in header.items()}
    floats = {name for name, entry in header.items() if entry["dtype"] in _SAFETENSORS_DTYPES}
    name = _pick_key(path, key, shapes, floats)
    entry = header[name]
    if entry["dtype"] not in _SAFETENSORS_DTYPES:
        raise TypeError(
            f"hostembed: unsupported dtype {entry['dtype']} for key {name!r} in '{path}': expected one of "
            f"{', '.join(_SAFETENSORS_DTYPES)}"
        )
    begin, end = entry["data_offsets"]
    rows = FileRows(path, 8 + header_len + begin, shapes[name], _SAFETENSORS_DTYPES[entry["dtype"]])
    if len(rows.shape) == 2 and end - begin != rows.nbytes:
        raise ValueError(
            f"hostembed: '{path}' key {name!r} spans {end - begin} bytes, but shape {list(rows.shape)} of "
            f"{entry['dtype']} needs {rows.nbytes}"
        )
    _check_covered(path, 8 + header_len + end, f"key {name!r}")
    return rows


def _torch_file_tensor(path, key):
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError/UnpicklingError/... for a damaged archive
        raise ValueError(f"hostembed: cannot read '{path}' as a torch.save file: {exc}") from exc
    if isinstance(loaded, torch.Tensor):
        if key is not None:
            raise ValueError(f"hostembed: '{path}' holds a single tensor, so key={key!r} does not apply")
    elif not isinstance(loaded, Mapping):
        raise ValueError(
            f"hostembed: '{path}' holds a {type(loaded).__name__}; expected a tensor or a state_dict-like mapping"
        )
    else:
        tensors = dict(_flatten(loaded))
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        floats = {name for name, t in tensors.items() if t.is_floating_point()}
        loaded = tensors[_pick_key(path, key, shapes, floats)]
    return _as_file_rows(path, loaded)


def _as_file_rows(path, tensor):
    """Where the mmap-loaded tensor's rows lie in the file, so they can be
    pread like a .npy: copying through the mapping page-faults every 4 KiB
    and was 2x slower. Only for a mapping this module made and nobody has
    written to (a private mapping's written pages differ from the file)."""
    region = mapped_file_region(tensor.data_ptr()) if tensor.is_contiguous() and tensor.dim() == 2 else None
    if region is None or not os.path.samefile(region[0], path):
        return tensor
    return FileRows(path, region[1], tuple(tensor.shape), tensor.dtype)


def _flatten(mapping, prefix=""):
    """Tensors of nested mappings under dotted names ({"model": {"emb.weight": t}} -> "model.emb.weight")."""
    for name, value in mapping.items():
        full = f"{prefix}{name}"
        if isinstance(value, torch.Tensor):
            yield full, value
        elif isinstance(value, Mapping):
            yield from _flatten(value, full + ".")


def _pick_key(path, key, shapes, floats):
    if key is not None:
        if key not in shapes:
            raise KeyError(f"hostembed: no key {key!r} in '{path}'; its keys are {sorted(shapes)}")
        return key
    tables = sorted(name for name in floats if len(shapes[name]) == 2)
    if len(tables) == 1:
        return tables[0]
    if "weight" in shapes:
        return "weight"
    if not tables:
        raise ValueError(f"hostembed: '{path}' holds no 2-D float tensor; its keys are {sorted(shapes)}")
    raise ValueError(f"hostembed: '{path}' holds several 2-D float tensors {tables}; pass key= to choose one")
