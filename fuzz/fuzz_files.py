"""Fuzzing Embedding.from_pretrained(path) with hostile .npy, .safetensors
and torch.save files (atheris, libFuzzer).

    pip install atheris
    python fuzz/fuzz_files.py fuzz/corpus/files -max_total_time=30
    python fuzz/fuzz_files.py fuzz/corpus/files -max_total_time=1800 -print_final_stats=1
    python fuzz/fuzz_files.py /tmp/fuzz_files_artifacts/crash-<sha>     # replay one input
    python fuzz/fuzz_files.py --write-seeds fuzz/corpus/files           # regenerate the seeds

The corpus directories given are only read: libFuzzer writes the inputs it
finds interesting into its first corpus directory, so this script puts a new
temporary directory (/tmp/fuzz_files_corpus_*, left behind for inspection)
in front of them. Findings go to /tmp/fuzz_files_artifacts/ unless
-artifact_prefix= is given; fuzz/files.dict is used unless -dict= is given,
and -timeout=10 (seconds an input may take) unless -timeout= is given.

An input is a format byte and a file: data[0] % 3 picks .npy, .safetensors
or .pt; data[0] & 0x80 passes key="weight"; data[1:] is written to a file of
that suffix in a tmpfs directory and loaded with
hostembed.Embedding.from_pretrained. Besides libFuzzer's byte mutations, a
custom mutator mutates inside the format's structure half of the time (a
.npy or safetensors header with its length field kept right, a record of the
zip archive with the archive rebuilt around it, CRCs and alignment right), so
that most inputs get past the first length check.

The property checked (anything else is a finding: the script raises, and
libFuzzer saves the input):

* the load raises FileNotFoundError, KeyError, ValueError or TypeError (the
  documented types; whatever torch.load raises for a .pt is mapped to
  ValueError), with a message naming the file, at most 1000 characters; or
* it loads, and the format's own reader agrees, bit for bit after the cast
  to float32: numpy.load for .npy, safetensors.safe_open for .safetensors,
  torch.load(weights_only=True) without mmap for .pt, the key picked by the
  documented rule (the only 2-D float tensor, else "weight");
* and the process stays under an address-space limit (RLIMIT_AS) of 1 GiB
  above what it had mapped at the start (an allocation beyond it fails with
  MemoryError: a finding), and its peak RSS grows by less than 512 MiB.
"""
import collections
import json
import os
import random
import resource
import struct
import sys
import tempfile
import traceback
import warnings
import zipfile

import atheris

import numpy as np  # not instrumented: only hostembed's code is
import torch

with atheris.instrument_imports(include=["hostembed"]):
    import hostembed


def _instrument_readers():
    """Coverage feedback from the Python parts of the formats' readers that
    hostembed calls (imported before, so instrumented one function at a
    time): the zip central directory, torch's weights_only unpickler."""
    import torch._weights_only_unpickler as unpickler
    import torch.serialization as serialization
    for func in (zipfile.ZipFile._RealGetContents, zipfile._EndRecData, zipfile._EndRecData64,
                 zipfile.ZipInfo._decodeExtra, unpickler.Unpickler.load, serialization._load):
        try:
            atheris.instrument_func(func)
        except Exception as exc:  # an atheris that cannot: fuzz without that feedback
            print(f"fuzz_files: not instrumenting {func.__qualname__}: {exc}", file=sys.stderr)


_instrument_readers()

warnings.simplefilter("ignore")
torch.set_num_threads(1)
hostembed.set_num_threads(1)

SUFFIXES = (".npy", ".safetensors", ".pt")
DOCUMENTED = (FileNotFoundError, KeyError, ValueError, TypeError)
MESSAGE_LIMIT = 1000
RSS_GROWTH_LIMIT = 512 << 20
AS_HEADROOM = 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))


# ---- building files (seeds, and the structure-aware mutator) -------------

def npy_file(array=None, header=None, version=1):
    """A .npy file of `array` (written by numpy), or of a raw header text padded like numpy's."""
    if header is None:
        import io
        out = io.BytesIO()
        np.lib.format.write_array(out, np.ascontiguousarray(array), version=(version, 0))
        return out.getvalue()
    preamble = 10 if version == 1 else 12
    text = header + " " * ((-(preamble + len(header) + 1)) % 64) + "\n"
    raw = text.encode("utf-8" if version == 3 else "latin1")
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack("<H" if version == 1 else "<I", len(raw)) + raw


def safetensors_file(header, payload=b""):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload


def zip_records(blob):
    """[(name, data)] of a zip archive, or None if Python's zipfile cannot read it."""
    try:
        import io
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            return [(i.filename, z.read(i)) for i in z.infolist()]
    except Exception:
        return None


def zip_archive(records):
    """A stored zip archive like torch.save writes (records' data 64-byte aligned)."""
    import io
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in records:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            pad = (-(z.fp.tell() + 30 + len(name.encode()) + 4)) % 64
            info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
            z.writestr(info, data)
    return out.getvalue()


def torch_file(obj):
    import io
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def write_seeds(directory):
    """Small valid files of each format and the issue's reproducers, each < 4 KiB."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((5, 3)).astype(np.float32)
    f32 = lambda shape, offsets, dtype="F32": {"dtype": dtype, "shape": shape, "data_offsets": offsets}  # noqa
    seeds = {
        # .npy (format byte 0)
        "npy_f32_v1": (0, npy_file(table)),
        "npy_f16_v2": (0, npy_file(table.astype(np.float16), version=2)),
        "npy_f64_v3": (0, npy_file(table.astype(np.float64), version=3)),
        "npy_fortran_1col": (0, npy_file(np.asfortranarray(table[:, :1]))),
        "npy_i8": (0, npy_file(np.arange(6, dtype=np.int8).reshape(2, 3))),
        "R7_str_in_shape.npy": (0, npy_file(header="{'descr': '<f4', 'fortran_order': False, "
                                                   "'shape': ('a', 300000000), }") + b"\0" * 96),
        "R8_npy_header_len_4GiB.npy": (0, b"\x93NUMPY\x02\x00\xff\xff\xff\xff{}" + b" " * 100),
        "R12_npy_truncated_len.npy": (0, b"\x93NUMPY\x01\x00\x10"),
        "R12_npy_descr_list.npy": (0, npy_file(header="{'descr': ['<f4'], 'fortran_order': False, "
                                                      "'shape': (6, 4), }") + b"\0" * 96),
        # .safetensors (format byte 1; 0x81: key="weight")
        "st_f32": (1, safetensors_file({"weight": f32([5, 3], [0, 60])}, table.tobytes())),
        "st_mixed_metadata": (0x81, safetensors_file(
            {"__metadata__": {"format": "pt"}, "weight": f32([2, 3], [0, 12], "BF16"),
             "ids": f32([4], [12, 44], "I64"), "mask": f32([3], [44, 47], "BOOL"), "empty": f32([0, 7], [47, 47])},
            bytes(range(47)))),
        "st_two_tables": (1, safetensors_file({"a": f32([2, 2], [0, 16], "F64"), "b": f32([2, 2], [16, 24], "F16")},
                                              bytes(range(24)))),
        "R6_neg_offsets_1GiB.safetensors": (1, safetensors_file(
            {"weight": f32([262144, 1024], [-1099511627776, -1098437885952])})),
        "R6b_neg_offsets_reads_header.safetensors": (1, safetensors_file({"weight": f32([2, 4], [-32, 0])})),
        "R7_str_in_shape.safetensors": (1, safetensors_file({"weight": f32(["a", 300000000], [0, 96])},
                                                            b"\0" * 96)),
        "R12_deep_json.safetensors": (1, safetensors_file(b"[" * 1500 + b"]" * 1500)),  # 100000 in the issue
        "R12_json_not_object.safetensors": (1, safetensors_file(b"5")),
        "R12_missing_shape.safetensors": (1, safetensors_file(
            {"weight": {"dtype": "F32", "data_offsets": [0, 96]}}, b"\0" * 96)),
        "R12_offsets_3.safetensors": (1, safetensors_file({"weight": f32([6, 4], [0, 96, 5])}, b"\0" * 96)),
        "R12_shape_list_dtype.safetensors": (1, safetensors_file(
            {"weight": {"dtype": ["F32"], "shape": [6, 4], "data_offsets": [0, 96]}}, b"\0" * 96)),
        # .pt (format byte 2; 0x82: key="weight")
        "pt_tensor": (2, torch_file(torch.from_numpy(table))),
        "pt_state_dict": (0x82, torch_file({"weight": torch.from_numpy(table).half(), "bias": torch.zeros(2)})),
        "pt_nested_view": (2, torch_file({"model": {"emb": torch.arange(12.0).view(4, 3)[1:3]}})),
    }
    r9 = zip_records(torch_file(torch.arange(24.0).view(6, 4)))
    blob = bytearray(zip_archive(r9))
    pos = blob.find(b"byteorder", blob.find(b"PK\x01\x02"))  # its central directory entry
    struct.pack_into("<II", blob, blob.rfind(b"PK\x01\x02", 0, pos) + 20, 0xFFFFFFFF, 0xFFFFFFFF)
    seeds["R9_pt_record_size_4GiB.pt"] = (2, bytes(blob))
    for name, (selector, blob) in seeds.items():
        data = bytes([selector]) + blob
        assert len(data) < 4096, (name, len(data))
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(seeds)} seeds to {directory}")


# ---- the structure-aware mutator --------------------------------------

def _mutate_part(part, rng, room):
    return atheris.Mutate(part, max(1, min(room, len(part) + 64 + rng.randrange(64))))


INTERESTING = [0, 1, 2, 3, 4, -1, -32, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1,
               2 ** 64, 10 ** 30, 1.5, True, None, "", "a", "F32", "F16", "BF16", "F64", "I64", "F4", "<f4", ">f4", [],
               [0], [2, 3], [0, 24], [-1, 2], [[1]], {}, {"a": 1}]


def _mutate_value(value, rng):
    """A value (an int, a list of ints, a string) changed the way a careless or hostile writer would."""
    choice = rng.random()
    if choice < 0.4:
        return rng.choice(INTERESTING)
    if isinstance(value, list) and value:
        value = list(value)
        i = rng.randrange(len(value))
        op = rng.randrange(4)
        if op == 0:
            value[i] = _mutate_value(value[i], rng)
        elif op == 1:
            del value[i]
        elif op == 2:
            value.insert(i, rng.choice(INTERESTING))
        else:
            value = value * 2
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value + rng.choice([-8, -4, -2, -1, 1, 2, 4, 8, value, -2 * value])
    return rng.choice(INTERESTING)


def _mutate_safetensors_json(header, rng):
    obj = json.loads(header)
    if not isinstance(obj, dict) or not obj:
        return None
    name = rng.choice(sorted(obj))
    entry = obj[name]
    op = rng.random()
    if op < 0.1:
        obj[name + "x"] = json.loads(json.dumps(entry))  # a duplicate entry under a new name
    elif op < 0.15:
        del obj[name]
    elif isinstance(entry, dict) and entry:
        field = rng.choice(sorted(entry) + ["extra"])
        if rng.random() < 0.1:
            entry.pop(field, None)
        else:
            entry[field] = _mutate_value(entry.get(field), rng)
    else:
        obj[name] = _mutate_value(entry, rng)
    return json.dumps(obj).encode()


def _mutate_npy_literal(header, rng):
    import ast
    obj = ast.literal_eval(header.decode("latin1"))
    if not isinstance(obj, dict) or not obj:
        return None
    field = rng.choice(sorted(obj, key=repr) + ["extra"])
    if rng.random() < 0.1:
        obj.pop(field, None)
    else:
        value = _mutate_value(list(obj[field]) if isinstance(obj.get(field), tuple) else obj.get(field), rng)
        obj[field] = tuple(value) if isinstance(value, list) and field == "shape" else value
    text = repr(obj)
    return (text + " " * ((-(10 + len(text) + 1)) % 64) + "\n").encode("latin1")


def custom_mutator(data, max_size, seed):
    rng = random.Random(seed)
    if len(data) < 2 or rng.random() < 0.5:
        return atheris.Mutate(data, max_size)
    selector, body = data[0], data[1:]
    suffix = SUFFIXES[selector % 3]
    room = max_size - 1
    try:
        if suffix == ".safetensors" and len(body) >= 8:
            n = struct.unpack_from("<Q", body)[0]
            if n <= len(body) - 8:
                header, payload = body[8:8 + n], body[8 + n:]
                structured = _mutate_safetensors_json(header, rng) if rng.random() < 0.4 else None
                if structured is not None:
                    header = structured
                    if rng.random() < 0.3:
                        payload = payload[:len(payload) + rng.choice([-8, -4, -1])] if rng.random() < 0.5 else \
                            payload + bytes(rng.choice([1, 4, 8, 24]))
                elif rng.random() < 0.8:
                    header = _mutate_part(header, rng, room - 8 - len(payload))
                else:
                    payload = _mutate_part(payload, rng, room - 8 - len(header))
                return (bytes([selector]) + struct.pack("<Q", len(header)) + header + payload)[:max_size]
        elif suffix == ".npy" and len(body) >= 10 and body[:6] == b"\x93NUMPY" and body[6] in (1, 2, 3):
            fmt, start = ("<H", 10) if body[6] == 1 else ("<I", 12)
            n = struct.unpack_from(fmt, body, 8)[0]
            if start + n <= len(body):
                header, payload = body[start:start + n], body[start + n:]
                structured = _mutate_npy_literal(header, rng) if rng.random() < 0.4 else None
                if structured is not None:
                    header = structured
                elif rng.random() < 0.8:
                    header = _mutate_part(header, rng, min(room - start - len(payload), 65535))
                else:
                    payload = _mutate_part(payload, rng, room - start - len(header))
                return (bytes([selector]) + body[:8] + struct.pack(fmt, len(header)) + header + payload)[:max_size]
        elif suffix == ".pt":
            records = zip_records(body)
            if records:
                i = rng.randrange(len(records))
                name, part = records[i]
                if rng.random() < 0.1:
                    name = _mutate_part(name.encode(), rng, 80).decode("latin1")
                else:
                    part = _mutate_part(part, rng, max(1, room - len(body) + len(part)))
                records[i] = (name, part)
                return (bytes([selector]) + zip_archive(records))[:max_size]
    except Exception:
        pass
    return atheris.Mutate(data, max_size)


# ---- the target ----------------------------------------------------------

class Target:
    def __init__(self):
        self.directory = tempfile.mkdtemp(prefix="fuzz_files_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.count = 0
        self.outcomes = collections.Counter()
        # Warm up (lazy imports, the reader's threads, torch.load's machinery)
        # before the baseline and the address-space limit.
        warm = os.path.join(self.directory, "warm.pt")
        with open(warm, "wb") as f:
            f.write(torch_file({"weight": torch.zeros(3, 2)}))
        hostembed.Embedding.from_pretrained(warm)
        with open("/proc/self/status") as status:
            vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + AS_HEADROOM, resource.getrlimit(resource.RLIMIT_AS)[1]))
        self.base_rss = self.peak_rss()

    @staticmethod
    def peak_rss():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def write(self, body, suffix):
        # A new file each time, renamed into place: a mapping of the previous
        # one (torch.load(mmap=True)) still sees its own, unlinked file.
        self.count += 1
        path = os.path.join(self.directory, f"input{suffix}")
        tmp = os.path.join(self.directory, f"tmp{self.count}")
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, path)
        return path

    def __call__(self, data):
        if not data:
            return
        suffix = SUFFIXES[data[0] % 3]
        key = "weight" if data[0] & 0x80 and suffix != ".npy" else None
        path = self.write(data[1:], suffix)
        if self.count & (self.count - 1) == 0 and self.count >= 4096:  # a report at each power of two
            print(f"fuzz_files outcomes after {self.count} inputs: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())), file=sys.stderr, flush=True)
        try:
            emb = hostembed.Embedding.from_pretrained(path, key=key)
        except DOCUMENTED as exc:
            self.outcomes[f"{suffix}:{type(exc).__name__}"] += 1
            message = str(exc)
            if len(message) > MESSAGE_LIMIT:
                raise AssertionError(f"a message of {len(message)} characters: {message[:300]}...") from exc
            if os.path.basename(path) not in message:
                raise AssertionError(f"the message does not name the file: {message[:300]}") from exc
            self.check_rss()
            return
        got = emb.weight.detach().clone()
        del emb
        self.outcomes[f"{suffix}:loaded"] += 1
        self.check_rss()
        expected = reference(path, suffix, key)
        if not same_bits(got, expected):
            raise AssertionError(f"loaded {list(got.shape)} {got.view(-1)[:6].tolist()}, the format's reader "
                                 f"gives {list(expected.shape)} {expected.view(-1)[:6].tolist()}")

    def check_rss(self):
        grown = self.peak_rss() - self.base_rss
        if grown > RSS_GROWTH_LIMIT:
            raise AssertionError(f"peak RSS grew by {grown >> 20} MiB")


def same_bits(a, b):
    """Equal shapes, dtypes and bits, NaNs equal to NaNs (whatever their payload)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    nan = a.isnan()
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])


def _pick(shapes, floats, key):
    """The documented default: the only 2-D float tensor, else "weight"."""
    if key is not None:
        return key
    tables = [name for name in floats if len(shapes[name]) == 2]
    return tables[0] if len(tables) == 1 else "weight"


def _flatten(mapping, prefix="", seen=None):
    seen = seen if seen is not None else {id(mapping)}
    for name, value in mapping.items():
        if isinstance(value, torch.Tensor):
            yield f"{prefix}{name}", value
        elif isinstance(value, dict) and id(value) not in seen:
            seen.add(id(value))
            yield from _flatten(value, f"{prefix}{name}.", seen)


def reference(path, suffix, key):
    """The table the format's own reader gives (in the file's dtype, which
    the table keeps), or it raises (a finding)."""
    if suffix == ".npy":
        return torch.from_numpy(np.ascontiguousarray(np.load(path, allow_pickle=False)))
    if suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(path, "pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            shapes = {name: s.get_shape() for name, s in slices.items()}
            floats = {name for name, s in slices.items() if s.get_dtype() in ("F32", "F16", "BF16", "F64")}
            return f.get_tensor(_pick(shapes, floats, key))
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(loaded, torch.Tensor):
        return loaded
    tensors = dict(_flatten(loaded))
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    floats = {name for name, t in tensors.items() if t.is_floating_point()}
    return tensors[_pick(shapes, floats, key)]


def main():
    args = sys.argv[1:]
    if args[:1] == ["--write-seeds"]:
        write_seeds(args[1] if len(args) > 1 else os.path.join(HERE, "corpus", "files"))
        return
    flags = [a for a in args if a.startswith("-")]
    paths = [a for a in args if not a.startswith("-")]
    if not any(f.startswith("-artifact_prefix=") for f in flags):
        os.makedirs("/tmp/fuzz_files_artifacts", exist_ok=True)
        flags.append("-artifact_prefix=/tmp/fuzz_files_artifacts/")
    if not any(f.startswith("-dict=") for f in flags):
        flags.append(f"-dict={os.path.join(HERE, 'files.dict')}")
    if not any(f.startswith("-timeout=") for f in flags):
        flags.append("-timeout=10")
    if paths and all(os.path.isdir(p) for p in paths):
        # libFuzzer writes new inputs into its first corpus directory: not the seeds'.
        paths.insert(0, tempfile.mkdtemp(prefix="fuzz_files_corpus_"))
    target = Target()

    def test_one_input(data):
        try:
            target(data)
        except Exception:
            traceback.print_exc()
            raise

    atheris.Setup([sys.argv[0]] + flags + paths, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
