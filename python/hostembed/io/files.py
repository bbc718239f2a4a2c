"""Finding a 2-D table inside a .npy, .safetensors or torch.save file.

For .npy and .safetensors the headers are parsed here (both are a small
header followed by raw little-endian rows), so the rows can then be read
with pread straight into the table, a chunk at a time, never mapping or
buffering the whole file. A torch.save file is a zip archive whose pickle
only torch can interpret safely (weights_only), so it is opened with
torch.load(mmap=True): nothing is read until touched, and the copy releases
the mapped pages as it goes (_stream.copy_rows).

Files are untrusted input. Every header field is checked for type, sign and
range against the file's size before anything proportional to a size the
file claims is allocated or read, nothing recurses on nesting the file
chooses, and messages quote file content cut to about 100 characters.
Errors, the same for every format:

* FileNotFoundError: no such path (IsADirectoryError: a directory).
* KeyError: key= names no entry of the file; the message lists (the first
  few of) its keys.
* TypeError: the chosen entry's dtype is not one a table loads from
  (float32, float16, bfloat16, float64; little-endian for .npy).
* ValueError: anything else wrong with the file: a suffix that names no
  supported format, not a regular file, bad magic, a truncated file, a
  malformed header, a field of the wrong type, sign or range (the message
  names the file, the entry and field, what was expected and what was
  found), data that does not fit in the file, not a 2-D table, no key= where
  the choice is ambiguous, and whatever torch.load raises for a damaged
  archive.

Limits: a .npy header of at most 10000 bytes (numpy's own max_header_size), a
safetensors header of at most 100,000,000 bytes (the safetensors library's
MAX_HEADER_SIZE), headers and state_dicts nested at most 16 levels
(_MAX_NESTING; valid files use 2 to 4).

torch.save files, what is guarded and what cannot be: before torch.load runs,
the zip archive's records (check_torch_archive, which hostembed.load runs
too): every record stored uncompressed, the sizes its central directory entry
(read with Python's zipfile) and its local header claim the same, its data
inside the file (torch allocates a record's claimed size before reading it:
R9, and a 4 GiB 'data.pkl' in a 1 KB file); after it, the chosen tensor: a
dense CPU tensor whose elements fit in its storage, a storage that is exactly
one storage record of the archive.
What runs in between is torch's: its zip reader (miniz) parses the archive
again, and its weights_only unpickler the pickle. An archive built so that
Python's zipfile and miniz find different central directories could still
make torch allocate (not touch) the size a record claims; the unpickler's time
and memory grow with the pickle's size (bounded by the file's size), and a
tensor torch did not map from the file (none is, under mmap=True) is not
compared with the records.
"""
import ast
import json
import os
import re
import reprlib
import stat
import struct
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .stream import mapped_file_region

SUPPORTED_SUFFIXES = (".pt", ".pth", ".safetensors", ".npy")

# dtypes a table may be loaded from (the table itself is float32).
LOADABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_NPY_DTYPES = {"<f4": torch.float32, "<f2": torch.float16, "<f8": torch.float64}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
# Bits per element of every dtype the safetensors library (0.8) accepts: the
# data_offsets of every entry are checked, as the library does, not only the
# chosen one's.
_SAFETENSORS_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
                     "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
                     "F64": 64, "I64": 64, "U64": 64, "C64": 64}

_NPY_MAX_HEADER = 10000  # numpy.lib.format's default max_header_size
_SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library's MAX_HEADER_SIZE
_MAX_NESTING = 16  # brackets in a header, mappings in a state_dict: valid files use 2 to 4
_U64 = 1 << 64
_MAX_SHAPE_BYTES = (1 << 63) - 1  # a table's shape must be a torch size: its bytes fit an int64
_LISTED_KEYS = 10

_short = reprlib.Repr()
_short.maxstring, _short.maxlist, _short.maxtuple, _short.maxdict, _short.maxlong, _short.maxother = \
    60, 8, 8, 4, 40, 60


def _quote(value, limit=100):
    """repr(value) for a message, never longer than about `limit` characters
    (reprlib cuts long containers and strings before they are formatted)."""
    text = _short.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _cut(text, limit):
    """An exception's message for a message of ours, cut to `limit` characters."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _keys_text(names):
    names = sorted(names)
    quoted = [_quote(name, 40) for name in names[:_LISTED_KEYS]]
    if len(names) <= _LISTED_KEYS:
        return f"its keys are [{', '.join(quoted)}]"
    return f"it has {len(names)} keys: [{', '.join(quoted)}] and {len(names) - _LISTED_KEYS} more"


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
    that is not a float type the table can take); see the module docstring."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"hostembed: no such file: '{path}'")
    if os.path.isdir(path):
        raise IsADirectoryError(f"hostembed: expected a file, '{path}' is a directory")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise ValueError(
            f"hostembed: cannot tell the format of '{path}' from its suffix '{suffix}': expected one of "
            f"{', '.join(SUPPORTED_SUFFIXES)}"
        )
    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open, a device never end
        raise ValueError(f"hostembed: '{path}' is not a regular file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if suffix == ".npy":
            if key is not None:
                raise ValueError(f"hostembed: a .npy file holds one array, so key={key!r} does not apply ('{path}')")
            rows = _npy_rows(path, f, size)
        elif suffix == ".safetensors":
            rows = _safetensors_rows(path, f, size, key)
        else:
            rows = _torch_file_tensor(path, f, size, key)
    check_table_like(rows.shape, rows.dtype, where=f"'{path}'" + ("" if key is None else f" key {key!r}"))
    return rows


def check_table_like(shape, dtype, where):
    if len(shape) != 2:
        raise ValueError(f"hostembed: expected a 2-D table in {where}, found shape {_quote(list(shape))}")
    if dtype not in LOADABLE:
        names = ", ".join(str(d).replace("torch.", "") for d in LOADABLE)
        raise TypeError(f"hostembed: unsupported dtype {dtype} in {where}: expected one of {names}")


def _read_exact(path, f, n, what, size):
    """n bytes from f (n already checked against the file's size), or a
    ValueError if the file came up short (it changed under us)."""
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"hostembed: '{path}' is truncated: {what} needs {n} bytes, the file has {size}")
    return data


def _shape_bytes(shape, itemsize):
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * itemsize


# ---------------------------------------------------------------- .npy
#
# numpy.lib.format's reader is not used (numpy is not a runtime dependency
# either): it reads the header length's worth of bytes before comparing it
# with max_header_size (R8: a 4 GiB buffer), and numpy.dtype() of a hostile
# descr raises assorted types. The rules below are numpy's (exact key set,
# shape a tuple of ints, fortran_order a bool, versions 1.0 to 3.0, the
# header a Python literal read by ast.literal_eval, at most 10000 bytes),
# plus what a table needs (a float descr from the allow-list, shape
# non-negative, the data inside the file), and they are checked before
# anything is read; tests/test_hostile_files.py compares acceptance and
# values with numpy.load.

_NPY_PREAMBLE = {1: ("<H", 10), 2: ("<I", 12), 3: ("<I", 12)}
# The header's tokens: ast.literal_eval only ever sees these (no operators,
# names or calls; a lone minus sign only in front of digits).
_NPY_TOKEN = re.compile(r"""\s+|'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*"|-?\d+|True\b|False\b|[{}()\[\]:,]""")
_NPY_KEYS = ("descr", "fortran_order", "shape")


def _npy_literal(path, text):
    """ast.literal_eval of a .npy header once its tokens are known to be
    harmless: literals, brackets at most _MAX_NESTING deep."""
    depth = pos = 0
    while pos < len(text):
        match = _NPY_TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"hostembed: '{path}' has a malformed .npy header: unexpected "
                             f"{_quote(text[pos:pos + 20])} at character {pos}; expected a dict literal such as "
                             "{'descr': '<f4', 'fortran_order': False, 'shape': (1000, 64)}")
        token = match.group()
        if token in "({[":
            depth += 1
            if depth > _MAX_NESTING:
                raise ValueError(f"hostembed: '{path}' has a malformed .npy header: brackets nested deeper than "
                                 f"{_MAX_NESTING} levels")
        elif token in ")}]":
            depth -= 1
        pos = match.end()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError) as exc:  # TypeError: an unhashable dict key
        raise ValueError(f"hostembed: '{path}' has a malformed .npy header: {_cut(str(exc), 160)}") from None


def _npy_rows(path, f, size):
    magic = f.read(8)
    if len(magic) < 8 or magic[:6] != b"\x93NUMPY":
        raise ValueError(f"hostembed: '{path}' is not a .npy file (bad magic bytes: expected b'\\x93NUMPY', found "
                         f"{_quote(magic[:6])})")
    major, minor = magic[6], magic[7]
    if major not in _NPY_PREAMBLE or minor != 0:
        raise ValueError(f"hostembed: '{path}' has .npy format version {major}.{minor}, expected 1.0, 2.0 or 3.0")
    length_format, header_start = _NPY_PREAMBLE[major]
    if size < header_start:
        raise ValueError(f"hostembed: '{path}' is truncated: its header length field needs bytes 8 to "
                         f"{header_start}, the file has {size} bytes")
    (header_len,) = struct.unpack(length_format, _read_exact(path, f, header_start - 8, "the header length", size))
    if header_len > _NPY_MAX_HEADER:
        raise ValueError(f"hostembed: '{path}' is not a valid .npy file: its header length {header_len} exceeds "
                         f"{_NPY_MAX_HEADER} bytes (numpy's own max_header_size)")
    if header_start + header_len > size:
        raise ValueError(f"hostembed: '{path}' is truncated: its .npy header length {header_len} runs past the "
                         f"end of the file ({size} bytes)")
    raw = _read_exact(path, f, header_len, "the .npy header", size)
    try:
        text = raw.decode("utf-8" if major == 3 else "latin1")
    except UnicodeDecodeError as exc:
        raise ValueError(f"hostembed: '{path}' has a .npy version 3 header that is not UTF-8: {exc.reason}") from None
    header = _npy_literal(path, text)
    if not isinstance(header, dict):
        raise ValueError(f"hostembed: '{path}' has a malformed .npy header: expected a dict, found "
                         f"{type(header).__name__}")
    if set(header) != set(_NPY_KEYS):
        raise ValueError(f"hostembed: '{path}' has a malformed .npy header: expected the keys 'descr', "
                         f"'fortran_order', 'shape', found {_quote(sorted(map(repr, header)))}")
    descr, fortran, shape = header["descr"], header["fortran_order"], header["shape"]
    if not isinstance(descr, str) or descr not in _NPY_DTYPES:
        raise TypeError(
            f"hostembed: unsupported dtype {_quote(descr)} in field 'descr' of '{path}': expected little-endian "
            "float16, float32 or float64 ('<f2', '<f4', '<f8')"
        )
    if not isinstance(fortran, bool):
        raise ValueError(f"hostembed: '{path}' .npy header field 'fortran_order': expected True or False, found "
                         f"{_quote(fortran)}")
    if not (isinstance(shape, tuple) and all(type(dim) is int and dim >= 0 for dim in shape)):
        raise ValueError(f"hostembed: '{path}' .npy header field 'shape': expected a tuple of non-negative ints, "
                         f"found {_quote(shape)}")
    dtype = _NPY_DTYPES[descr]
    if _shape_bytes((max(dim, 1) for dim in shape), dtype.itemsize) > _MAX_SHAPE_BYTES:
        raise ValueError(f"hostembed: '{path}' .npy header field 'shape': {_quote(shape)} is too large for a "
                         "tensor (its size overflows an int64)")
    if fortran and len(shape) == 2 and shape[0] > 1 and shape[1] > 1:
        # Rows would be strided across the whole file: no streaming read.
        raise ValueError(
            f"hostembed: '{path}' stores its array in Fortran (column-major) order; save it row-major "
            "(np.save(path, np.ascontiguousarray(a)))"
        )
    offset = header_start + header_len
    end = offset + _shape_bytes(shape, dtype.itemsize)
    if end > size:
        raise ValueError(f"hostembed: '{path}' is truncated: a {_quote(list(shape))} {descr} array needs {end} "
                         f"bytes, the file has {size}")
    return FileRows(path, offset, shape, dtype)


# -------------------------------------------------------- .safetensors
#
# The safetensors library is optional at runtime, and its Python API gives
# keys, shapes and dtypes but not the data offsets that the pread needs
# (safe_open in 0.8 has offset_keys(), the order, but no offsets). So the
# header is parsed here, validated exactly as the library's Rust reader does
# (Metadata::validate: header at most 100 MB and inside the file, UTF-8 JSON,
# offsets of all entries sorted, contiguous from 0, end - begin == numel x
# dtype size, the last end at the end of the file, no integer overflow), and
# more strictly where it costs nothing: no duplicate keys, nesting bounded
# before json.loads recurses, integers of at most 20 digits.
# tests/test_hostile_files.py compares acceptance and values with safe_open.

def _json_depth_ok(text, limit):
    """Whether the JSON text nests brackets at most `limit` deep, outside its
    strings (unbalanced brackets count as too deep: json rejects them
    anyway). Linear: escapes out, strings out, then one pass per level
    dropping the innermost empty pairs."""
    outside = "".join(re.sub(r"\\.", "", text, flags=re.DOTALL).split('"')[::2])
    brackets = re.sub(r"[^\[\]{}]", "", outside)
    for _ in range(limit):
        if not brackets:
            return True
        brackets = re.sub(r"\[\]|\{\}", "", brackets)
    return not brackets


def _json_object(pairs):
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        name = next(name for name, _ in pairs if name in seen or seen.add(name))
        raise ValueError(f"duplicate key {_quote(name, 60)}")
    return obj


class _LongInt:
    """A JSON integer of more than 21 characters, left unconverted: no field
    takes one (offsets and sizes are below 2**64), and converting it costs
    time quadratic in its length on Pythons without int_max_str_digits."""

    def __init__(self, text):
        self.digits = len(text)

    def __repr__(self):
        return f"<an integer of {self.digits} digits>"


def _json_int(text):
    return int(text) if len(text) <= 21 else _LongInt(text)


def _json_constant(name):
    raise ValueError(f"{name} is not JSON")


def _st_error(path, name, field, expected, found):
    return ValueError(f"hostembed: '{path}' entry {_quote(name, 60)} field '{field}': expected {expected}, found "
                      f"{_quote(found)}")


def _is_count(value):
    return type(value) is int and 0 <= value < _U64


def _safetensors_entries(path, header):
    """[(name, dtype, shape, begin, end)] of a parsed header, each field checked."""
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            if entry is not None and not (isinstance(entry, dict)
                                          and all(isinstance(v, str) for v in entry.values())):
                raise ValueError(f"hostembed: '{path}' field '__metadata__': expected an object of string values, "
                                 f"found {_quote(entry)}")
            continue
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"hostembed: '{path}' has an entry name that is not valid Unicode: "
                             f"{_quote(name, 60)}") from None
        if not isinstance(entry, dict):
            raise ValueError(f"hostembed: '{path}' entry {_quote(name, 60)}: expected a JSON object with dtype, "
                             f"shape and data_offsets, found {_quote(entry)}")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in entry:
                raise ValueError(f"hostembed: '{path}' entry {_quote(name, 60)}: missing field '{field}' (expected "
                                 "dtype, shape and data_offsets)")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _SAFETENSORS_BITS:
            raise _st_error(path, name, "dtype", f"a safetensors dtype ({', '.join(_SAFETENSORS_BITS)})", dtype)
        if not (isinstance(shape, list) and all(_is_count(dim) for dim in shape)):
            raise _st_error(path, name, "shape", "a list of non-negative ints", shape)
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(x) for x in offsets)):
            raise _st_error(path, name, "data_offsets", "2 non-negative ints [begin, end]", offsets)
        entries.append((name, dtype, shape, offsets[0], offsets[1]))
    return entries


def _safetensors_rows(path, f, size, key):
    if size < 8:
        raise ValueError(f"hostembed: '{path}' is truncated: no safetensors header length (8 bytes), the file has "
                         f"{size} bytes")
    (header_len,) = struct.unpack("<Q", _read_exact(path, f, 8, "the safetensors header length", size))
    if header_len > _SAFETENSORS_MAX_HEADER:
        raise ValueError(f"hostembed: '{path}' is not a valid safetensors file: its header length {header_len} exceeds "
                         f"{_SAFETENSORS_MAX_HEADER} bytes (the safetensors library's limit)")
    if 8 + header_len > size:
        raise ValueError(f"hostembed: '{path}' is truncated or not a safetensors file: its header length "
                         f"{header_len} runs past the end of the file (the file has {size} bytes)")
    raw = _read_exact(path, f, header_len, "the safetensors header", size)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"hostembed: '{path}' has a malformed safetensors header: not UTF-8 ({exc.reason} at "
                         f"byte {8 + exc.start})") from None
    if not _json_depth_ok(text, _MAX_NESTING):
        raise ValueError(f"hostembed: '{path}' has a malformed safetensors header: JSON nested deeper than "
                         f"{_MAX_NESTING} levels (or unbalanced brackets)")
    try:
        header = json.loads(text, object_pairs_hook=_json_object, parse_int=_json_int,
                            parse_constant=_json_constant)
    except ValueError as exc:  # json.JSONDecodeError and the hooks' errors
        raise ValueError(f"hostembed: '{path}' has a malformed safetensors header: {_cut(str(exc), 160)}") from None
    if not isinstance(header, dict):
        raise ValueError(f"hostembed: '{path}' has a malformed safetensors header: expected a JSON object "
                         f"({{name: {{dtype, shape, data_offsets}}}}), found {type(header).__name__}")
    entries = _safetensors_entries(path, header)
    # As the library: sorted by offsets, each entry starts where the previous ended.
    entries.sort(key=lambda e: (e[3], e[4]))
    start = 0
    for name, dtype, shape, begin, end in entries:
        if begin != start or end < begin:
            raise _st_error(path, name, "data_offsets",
                            f"[begin, end] to start at byte {start} (right after the previous entry) with end >= "
                            "begin", [begin, end])
        start = end
        numel = 1
        for dim in shape:
            numel *= dim
            if numel >= _U64:
                raise _st_error(path, name, "shape", "a shape whose size fits 64 bits (it overflows)", shape)
        bits = numel * _SAFETENSORS_BITS[dtype]
        if bits >= _U64 * 8:
            raise _st_error(path, name, "shape", f"a shape whose bytes as {dtype} fit 64 bits (it overflows)", shape)
        if bits % 8 or end - begin != bits // 8:
            raise _st_error(path, name, "data_offsets",
                            f"[begin, end] spanning {bits / 8:g} bytes (shape {_quote(shape, 60)} of {dtype})",
                            [begin, end])
    data_end = 8 + header_len + start
    if data_end > size:
        raise ValueError(f"hostembed: '{path}' is truncated: its tensors end at byte {data_end}, the file has "
                         f"{size} bytes")
    if data_end < size:
        raise ValueError(f"hostembed: '{path}' has {size - data_end} bytes after its last tensor (byte {data_end}); "
                         "a safetensors file ends with its last tensor's data")
    by_name = {e[0]: e for e in entries}
    shapes = {name: e[2] for name, e in by_name.items()}
    floats = {name for name, e in by_name.items() if e[1] in _SAFETENSORS_DTYPES}
    name = _pick_key(path, key, shapes, floats)
    _, dtype, shape, begin, _ = by_name[name]
    if dtype not in _SAFETENSORS_DTYPES:
        raise TypeError(
            f"hostembed: unsupported dtype {dtype} for key {_quote(name, 60)} in '{path}': expected one of "
            f"{', '.join(_SAFETENSORS_DTYPES)}"
        )
    if _shape_bytes((max(dim, 1) for dim in shape), 4) > _MAX_SHAPE_BYTES:
        raise _st_error(path, name, "shape", "a shape whose size fits an int64 (a torch size)", shape)
    return FileRows(path, 8 + header_len + begin, tuple(shape), _SAFETENSORS_DTYPES[dtype])


# --------------------------------------------------------- torch.save
#
# torch's reader is the only safe reader of the pickle, so it stays; what
# hostembed guards around it: the zip records (before torch.load reads any),
# and the tensor torch builds (before a table of its shape is allocated).

def check_torch_archive(path, f, size, cannot_read=None):
    """Checks the archive's records before torch reads any: every record
    stored (torch.load(mmap=True) maps storages in place and would read
    deflated bytes as data), the sizes its central directory entry and its
    local header claim the same, and its data inside the file (torch
    allocates the size a record claims before reading it: R9). Both
    hostembed.load and the .pt table reader go through here. `cannot_read`
    begins every refusal (default: "hostembed: cannot read '<path>' as a
    torch.save file"). Returns the archive's byte order (its 'byteorder'
    record, else torch's default) and {offset in the file: (name, size)} of
    its storage records."""
    cannot = cannot_read or f"hostembed: cannot read '{path}' as a torch.save file"

    def damaged(exc):
        f.seek(0)
        legacy = f.read(1) == b"\x80"  # a pickle: torch.save's format before torch 1.6
        hint = ("; it looks like torch.save's legacy format (before torch 1.6, or _use_new_zipfile_serialization="
                "False): pass torch.load(path) instead, or save it again" if legacy else "")
        return ValueError(f"{cannot}: not a valid zip archive ({type(exc).__name__}: {_cut(str(exc), 160)}){hint}")

    try:
        archive = zipfile.ZipFile(f)
        infos = archive.infolist()
    except Exception as exc:  # zipfile.BadZipFile, struct.error, UnicodeDecodeError, ... for a damaged archive
        raise damaged(exc) from None
    with archive:
        if not infos:
            raise ValueError(f"{cannot}: the zip archive is empty")
        # zipfile reads the central directory that ends at the end record, and
        # shifts every offset by the difference to where the record says it
        # is (data before the archive); torch's reader (miniz) reads it where
        # the record says. Both must read the same one, the one checked here.
        try:
            said = zipfile._EndRecData(f)[zipfile._ECD_OFFSET]
        except Exception:  # a zipfile without these internals: the check is skipped
            said = getattr(archive, "start_dir", None)
        if getattr(archive, "start_dir", said) != said:
            raise ValueError(f"{cannot}: its central directory is at byte {archive.start_dir}, but its end record "
                             f"says byte {said} (data before or inside the archive)")
    prefix = infos[0].filename.split("/", 1)[0]  # torch's archive name: its first record's folder
    storages, byteorder = {}, None
    for info in infos:
        start = _record_start(cannot, f, size, info)
        if info.filename.startswith(f"{prefix}/data/"):
            storages[start] = (info.filename, info.file_size)
        elif info.filename == f"{prefix}/byteorder" and byteorder is None:
            byteorder = info, start
    if byteorder is None:
        # as torch.load decides for an archive without the record
        default = torch.serialization.get_default_load_endianness()
        if default == torch.serialization.LoadEndianness.NATIVE:
            return sys.byteorder, storages
        return ("big" if default == torch.serialization.LoadEndianness.BIG else "little"), storages
    info, start = byteorder
    if info.file_size > 16:
        raise ValueError(f"{cannot}: record {_quote(info.filename, 60)} holds {info.file_size} bytes, expected "
                         "'little' or 'big'")
    # read here rather than with zipfile, which checks the record's CRC-32:
    # hostembed.save writes none (torch.load checks none)
    return os.pread(f.fileno(), info.file_size, start).decode("latin1"), storages


def _record_start(cannot, f, size, info):
    """Where a record's data begins in the file, once its central directory
    entry and its local header agree on its size and the data lies inside
    the file: miniz allocates the central directory's uncompressed size
    before it reads a record; a reader that trusts the local header would
    allocate that one."""
    record = _quote(info.filename, 60)
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{cannot}: record {record} is compressed (method {info.compress_type}); torch.save "
                         "stores records uncompressed, and torch.load(mmap=True) would read the compressed bytes "
                         "as data")
    if info.external_attr & 0x10 or info.filename.endswith("/") or info.flag_bits & 0x41:
        # torch's reader (miniz) extracts a "directory" as nothing (torch.load without mmap then
        # returns uninitialised memory as the storage), and refuses an encrypted one
        raise ValueError(f"{cannot}: record {record} is marked as a directory or as encrypted (torch.save writes "
                         "neither)")
    if info.file_size != info.compress_size or not 0 <= info.header_offset <= size - 30 - info.file_size:
        raise ValueError(f"{cannot}: record {record} claims {info.file_size} bytes ({info.compress_size} stored) "
                         f"at byte {info.header_offset}, the file has {size} bytes")
    local = os.pread(f.fileno(), 30, info.header_offset)
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        raise ValueError(f"{cannot}: record {record} has no local header at byte {info.header_offset}")
    stored, claimed = _local_sizes(f, info, local)
    if stored not in (0, info.file_size) or claimed not in (0, info.file_size):  # 0: the sizes follow the data
        raise ValueError(f"{cannot}: record {record} claims {claimed} bytes ({stored} stored) in its local header "
                         f"at byte {info.header_offset}, {info.file_size} in the central directory")
    start = info.header_offset + 30 + sum(struct.unpack_from("<HH", local, 26))
    if start + info.file_size > size:
        raise ValueError(f"{cannot}: record {record} of {info.file_size} bytes at byte {start} runs past the end "
                         f"of the file ({size} bytes)")
    return start


def _local_sizes(f, info, local):
    """The sizes (stored, uncompressed) a record's local header claims: its
    own fields, or, for a field marked 0xFFFFFFFF, its zip64 extra field's
    (uncompressed first); a marker without one stands as the claim."""
    stored, claimed = struct.unpack_from("<II", local, 18)
    if 0xFFFFFFFF not in (stored, claimed):
        return stored, claimed
    name_len, extra_len = struct.unpack_from("<HH", local, 26)
    extra = os.pread(f.fileno(), extra_len, info.header_offset + 30 + name_len)
    while len(extra) >= 4:
        kind, length = struct.unpack_from("<HH", extra)
        if kind == 1:
            values = iter(struct.unpack_from(f"<{min(length, len(extra) - 4) // 8}Q", extra, 4))
            claimed = next(values, claimed) if claimed == 0xFFFFFFFF else claimed
            return (next(values, stored) if stored == 0xFFFFFFFF else stored), claimed
        extra = extra[4 + length:]
    return stored, claimed


def _torch_file_tensor(path, f, size, key):
    byteorder, storages = check_torch_archive(path, f, size)
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError/UnpicklingError/... for a damaged archive
        raise ValueError(f"hostembed: cannot read '{path}' as a torch.save file: {type(exc).__name__}: "
                         f"{_cut(str(exc), 300)}") from None
    name = None
    if isinstance(loaded, torch.Tensor):
        if key is not None:
            raise ValueError(f"hostembed: '{path}' holds a single tensor, so key={key!r} does not apply")
    elif not isinstance(loaded, Mapping):
        raise ValueError(
            f"hostembed: '{path}' holds a {type(loaded).__name__}; expected a tensor or a state_dict-like mapping"
        )
    else:
        tensors = _flatten(path, loaded)
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        floats = {name for name, t in tensors.items() if t.is_floating_point()}
        name = _pick_key(path, key, shapes, floats)
        loaded = tensors[name]
    _check_loaded_tensor(path, name, loaded, size, storages)
    return _as_file_rows(path, loaded, size, byteorder)


def _check_loaded_tensor(path, name, tensor, size, storages):
    """The tensor's elements must be data in the file: a dense CPU tensor
    whose bytes fit in its storage (torch.load accepts a meta tensor, or a
    2**60-element view with zero strides over a few bytes, and a table of
    that shape would be allocated), a storage that is exactly one storage
    record of the archive (torch.load(mmap=True) does not compare the two
    sizes, torch.load without mmap refuses a mismatch). A storage torch did
    not map from the file (none does under mmap=True today) is not checked
    against the records."""
    what = f"'{path}'" + ("" if name is None else f" key {_quote(name, 60)}")
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        raise ValueError(f"hostembed: {what} is a {tensor.layout} tensor on {tensor.device.type}; expected a dense "
                         "CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    stored = storage.nbytes()
    if nbytes > stored or stored > size:
        raise ValueError(f"hostembed: {what} is a {_quote(list(tensor.shape))} view of {nbytes} bytes over a "
                         f"storage of {stored} bytes in a file of {size} (an expanded or overlapping view); save "
                         "tensor.contiguous() instead")
    region = mapped_file_region(storage.data_ptr()) if stored else None
    if region is not None and os.path.samefile(region[0], path):
        record = storages.get(region[1])
        if record is None or record[1] != stored:
            found = "no storage record starts there" if record is None else \
                f"its record {_quote(record[0], 60)} holds {record[1]} bytes"
            tensor_name = "its tensor" if name is None else f"key {_quote(name, 60)}"
            raise ValueError(f"hostembed: cannot read '{path}' as a torch.save file: {tensor_name} has a storage of "
                             f"{stored} bytes at byte {region[1]}, but {found}")


def _as_file_rows(path, tensor, size, byteorder):
    """Where the mmap-loaded tensor's rows lie in the file, so they can be
    pread like a .npy: copying through the mapping page-faults every 4 KiB
    and was 2x slower. Only for a mapping this module made and nobody has
    written to (a private mapping's written pages differ from the file): not
    for an archive of the other byte order, whose storages torch byteswapped
    in the mapping."""
    if byteorder != sys.byteorder:
        return tensor
    region = mapped_file_region(tensor.data_ptr()) if tensor.is_contiguous() and tensor.dim() == 2 else None
    if region is None or not os.path.samefile(region[0], path):
        return tensor
    rows = FileRows(path, region[1], tuple(tensor.shape), tensor.dtype)
    return rows if rows.offset + rows.nbytes <= size else tensor


def _flatten(path, mapping):
    """Tensors of nested mappings under dotted names ({"model": {"emb.weight": t}} -> "model.emb.weight").
    Iterative: a pickle chooses the nesting (at most _MAX_NESTING levels)
    and may hold a mapping that contains itself (visited once)."""
    tensors = {}
    seen = {id(mapping)}
    stack = [(mapping, "", 1)]
    while stack:
        current, prefix, depth = stack.pop()
        for name, value in current.items():
            full = f"{prefix}{name}"
            if isinstance(value, torch.Tensor):
                tensors.setdefault(full, value)
            elif isinstance(value, Mapping) and id(value) not in seen:
                if depth >= _MAX_NESTING:
                    raise ValueError(f"hostembed: '{path}' holds mappings nested deeper than {_MAX_NESTING} levels "
                                     f"(at {_quote(full, 60)})")
                seen.add(id(value))
                stack.append((value, full + ".", depth + 1))
    return tensors


def _pick_key(path, key, shapes, floats):
    if key is not None:
        if key not in shapes:
            raise KeyError(f"hostembed: no key {key!r} in '{path}'; {_keys_text(shapes)}")
        return key
    tables = sorted(name for name in floats if len(shapes[name]) == 2)
    if len(tables) == 1:
        return tables[0]
    if "weight" in shapes:
        return "weight"
    if not tables:
        raise ValueError(f"hostembed: '{path}' holds no 2-D float tensor; {_keys_text(shapes)}")
    listed = ", ".join(_quote(name, 40) for name in tables[:_LISTED_KEYS])
    more = "" if len(tables) <= _LISTED_KEYS else f" and {len(tables) - _LISTED_KEYS} more"
    raise ValueError(f"hostembed: '{path}' holds several 2-D float tensors [{listed}]{more}; pass key= to choose one")
