"""Hostile and malformed files for Embedding.from_pretrained(path).

Every reproducer of the 2026-11-22 file fuzzing issue (R6, R6b, R7, R8, R9,
R12) is rebuilt here byte for byte and must give the documented exception
(ValueError / TypeError / KeyError, see hostembed/io/files.py), naming the file and
the field, in a message of bounded length, without allocating anything
proportional to the size the file claims: those loads run in a child process
that measures its peak RSS (ru_maxrss) and runs under an address-space limit
(RLIMIT_AS) of 1 GiB above what it had mapped after the imports, so a
multi-GiB buffer requested and never touched fails too.

Valid files of each format must still load bit for bit, and what hostembed
accepts the formats' own readers (numpy, safetensors, torch.load) accept too,
with the same values.
"""
import json
import os
import struct
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import hostembed

MiB = 1 << 20
RSS_GROWTH_LIMIT = 64 * MiB  # a hostile file may cost this much, whatever size it claims
MESSAGE_LIMIT = 600  # characters of an error message, the tmp path included


# -- builders --------------------------------------------------------------

def safetensors_bytes(header, payload=b""):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload


def npy_bytes(header_text, payload=b"", version=1):
    """A .npy file with header_text padded like numpy pads it (total % 64 == 0)."""
    preamble = 10 if version == 1 else 12
    text = header_text + " " * ((-(preamble + len(header_text) + 1)) % 64) + "\n"
    raw = text.encode("utf-8" if version == 3 else "latin1")
    length = struct.pack("<H" if version == 1 else "<I", len(raw))
    return b"\x93NUMPY" + bytes([version, 0]) + length + raw + payload


def _pu(s):  # pickle BINUNICODE
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _pint(n):  # pickle BININT1 / LONG1
    if 0 <= n < 256:
        return b"K" + bytes([n])
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def tensor_pickle_ops(key="0", numel=6, shape=(3, 2), stride=(2, 1), offset=0, storage="FloatStorage"):
    """Pickle opcodes that rebuild a tensor over storage `key` the way torch.save writes it."""
    tup = lambda items: b"(" + b"".join(items) + b"t"  # noqa: E731
    pid = tup([_pu("storage"), b"ctorch\n" + storage.encode() + b"\n", _pu(key), _pu("cpu"), _pint(numel)])
    return (b"ctorch._utils\n_rebuild_tensor_v2\n(" + pid + b"Q" + _pint(offset) + tup([_pint(s) for s in shape])
            + tup([_pint(s) for s in stride]) + b"\x89ccollections\nOrderedDict\n)Rt" + b"R")


def state_dict_pickle(entries):
    return b"\x80\x02}" + b"".join(_pu(k) + v + b"s" for k, v in entries.items()) + b"."


def write_pt(path, pickle_bytes, storages, byteorder=b"little", compress=zipfile.ZIP_STORED):
    """A torch.save-like archive (records 64-byte aligned, as torch writes them)."""
    with zipfile.ZipFile(path, "w") as z:
        def add(name, data):
            info = zipfile.ZipInfo(f"archive/{name}", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = compress
            pad = (-(z.fp.tell() + 30 + len(info.filename) + 4)) % 64
            info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
            z.writestr(info, data)

        add("data.pkl", pickle_bytes)
        if byteorder is not None:
            add("byteorder", byteorder)
        for key, data in storages.items():
            add(f"data/{key}", data)
        add("version", b"3\n")
    return str(path)


# signature, offsets of the name's length, the name, the sizes (compressed, uncompressed)
_ZIP_HEADERS = {"central": (b"PK\x01\x02", 28, 46, 20), "local": (b"PK\x03\x04", 26, 30, 18)}


def patch_record_sizes(blob, name_suffix, size, header="central", uncompressed_only=False):
    """Sets the compressed and uncompressed sizes (or only the uncompressed
    one) of a record in the zip's central directory or its local header."""
    signature, name_len_at, name_at, sizes_at = _ZIP_HEADERS[header]
    blob = bytearray(blob)
    pos = 0
    while True:
        pos = blob.find(signature, pos)
        assert pos >= 0, name_suffix
        name_len = struct.unpack_from("<H", blob, pos + name_len_at)[0]
        if bytes(blob[pos + name_at:pos + name_at + name_len]).endswith(name_suffix):
            if uncompressed_only:
                struct.pack_into("<I", blob, pos + sizes_at + 4, size)
            else:
                struct.pack_into("<II", blob, pos + sizes_at, size, size)
            return bytes(blob)
        pos += 4


def reproducers():
    """name -> file bytes: the issue's minimal reproducers (tests check they match the shared copies)."""
    f32 = lambda shape, offsets: {"weight": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}  # noqa: E731
    files = {
        "R6_neg_offsets_1GiB.safetensors":
            safetensors_bytes(f32([262144, 1024], [-1099511627776, -1098437885952])),
        "R6b_neg_offsets_reads_header.safetensors": safetensors_bytes(f32([2, 4], [-32, 0])),
        "R7_str_in_shape.safetensors": safetensors_bytes(f32(["a", 300000000], [0, 96]), b"\0" * 96),
        "R7_str_in_shape.npy": npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': ('a', 300000000), }",
                                         b"\0" * 96),
        "R8_npy_header_len_4GiB.npy": b"\x93NUMPY\x02\x00\xff\xff\xff\xff{}" + b" " * 100,
        "R12_deep_json.safetensors": safetensors_bytes(b"[" * 100000 + b"]" * 100000),
        "R12_json_not_object.safetensors": safetensors_bytes(b"5"),
        "R12_missing_shape.safetensors":
            safetensors_bytes({"weight": {"dtype": "F32", "data_offsets": [0, 96]}}, b"\0" * 96),
        "R12_offsets_3.safetensors": safetensors_bytes(f32([6, 4], [0, 96, 5]), b"\0" * 96),
        "R12_shape_list_dtype.safetensors":
            safetensors_bytes({"weight": {"dtype": ["F32"], "shape": [6, 4], "data_offsets": [0, 96]}}, b"\0" * 96),
        "R12_npy_truncated_len.npy": b"\x93NUMPY\x01\x00\x10",
        "R12_npy_descr_list.npy": npy_bytes("{'descr': ['<f4'], 'fortran_order': False, 'shape': (6, 4), }",
                                            b"\0" * 96),
    }
    return files


def r9_bytes(tmp_path):
    """R9: a torch.save archive whose 'byteorder' record claims 4 GiB in the central directory."""
    path = tmp_path / "r9_src.pt"
    torch.save(torch.arange(24.0).view(6, 4), path)
    return patch_record_sizes(path.read_bytes(), b"/byteorder", 0xFFFFFFFF)


def extra_hostile_pt(tmp_path):
    """torch.save archives found while fixing R9 (torch.load accepts each of them)."""
    data = struct.pack("<6f", *range(6))
    out = {}
    # a 2-D view of 2**60 elements over a 24-byte storage (strides 0): hostembed allocated the claimed table
    out["broadcast_view.pt"] = write_pt(tmp_path / "broadcast_view.pt", state_dict_pickle(
        {"weight": tensor_pickle_ops(shape=(2 ** 40, 2 ** 20), stride=(0, 0))}), {"0": data})
    # a 1 GiB broadcast view: small enough to be allocated and filled
    out["broadcast_view_1GiB.pt"] = write_pt(tmp_path / "broadcast_view_1GiB.pt", state_dict_pickle(
        {"weight": tensor_pickle_ops(shape=(2 ** 18, 2 ** 10), stride=(0, 1), numel=1024)}),
        {"0": b"\0" * 4096})
    # a meta tensor: no data at all, a 4 TiB shape
    meta = tmp_path / "meta.pt"
    torch.save({"weight": torch.empty(2 ** 20, 2 ** 20, device="meta")}, meta)
    out["meta.pt"] = str(meta)
    # a state_dict nested 100000 deep (hostembed's flattening recursed)
    deep = (b"\x80\x02" + (b"}" + _pu("a")) * 100000 + b"}" + _pu("weight") + tensor_pickle_ops()
            + b"s" * 100001 + b".")
    out["deep_state_dict.pt"] = write_pt(tmp_path / "deep_state_dict.pt", deep, {"0": data})
    # a state_dict that contains itself (pickle memo): the flattening never ended
    cyclic = b"\x80\x02}q\x00" + _pu("self") + b"h\x00s" + _pu("weight") + tensor_pickle_ops() + b"s."
    out["cyclic_state_dict.pt"] = write_pt(tmp_path / "cyclic_state_dict.pt", cyclic, {"0": data})
    return out


# -- the child that measures ---------------------------------------------

_CHILD = r"""
import json, os, resource, signal, sys
import torch, hostembed

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def too_slow(signum, frame):
    raise TimeoutError("no answer within 60 s")

signal.signal(signal.SIGALRM, too_slow)

hostembed.Embedding.from_pretrained(sys.argv[1])  # warm up: lazy imports, the reader's threads
with open("/proc/self/status") as status:
    vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), hard))
base = peak()
results = {}
for path in sys.argv[2:]:
    signal.alarm(60)  # a thread start refused under the limit once hung the old code
    try:
        emb = hostembed.Embedding.from_pretrained(path)
        res = {"loaded": list(emb.weight.shape)}
        del emb
    except BaseException as exc:
        text = str(exc)
        res = {"type": type(exc).__name__, "message": text[:2000], "length": len(text)}
    signal.alarm(0)
    res["growth"] = peak() - base
    results[os.path.basename(path)] = res
    print(os.path.basename(path), res, file=sys.stderr, flush=True)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def child_results(tmp_path_factory):
    """Loads every hostile file in one child process; name -> result."""
    tmp_path = tmp_path_factory.mktemp("hostile")
    paths = []
    for name, blob in reproducers().items():
        (tmp_path / name).write_bytes(blob)
        paths.append(str(tmp_path / name))
    (tmp_path / "R9_pt_record_size_4GiB.pt").write_bytes(r9_bytes(tmp_path))
    paths.append(str(tmp_path / "R9_pt_record_size_4GiB.pt"))
    paths += extra_hostile_pt(tmp_path).values()
    warm = tmp_path / "warm.npy"
    np.save(warm, np.ones((4, 3), dtype=np.float32))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.run([sys.executable, "-c", _CHILD, str(warm), *paths], capture_output=True, text=True,
                           timeout=300, env=env)
    assert child.returncode == 0, child.stderr[-4000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    return {name: dict(res, path=str(tmp_path / name)) for name, res in results.items()}


def check_refused(res, exc_type, *fragments):
    """A clean exc_type naming the file and each fragment, short, and no memory spent."""
    assert "loaded" not in res, f"loaded a hostile file as {res['loaded']}"
    assert res["type"] == exc_type.__name__, res
    message = res["message"]
    assert res["length"] <= MESSAGE_LIMIT, f"message of {res['length']} characters: {message[:300]}..."
    assert os.path.basename(res["path"]) in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert res["growth"] < RSS_GROWTH_LIMIT, f"peak RSS grew by {res['growth'] / MiB:.0f} MiB"


def test_reproducers_match_the_issue_files():
    # shared/ lies beside the repository's checkout, for a session and CI alike.
    shared = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shared",
                          "repro-2026-11-22")
    if not os.path.isdir(shared):
        pytest.skip(f"the issue's reproducer directory is not here ({shared})")
    for name, blob in reproducers().items():
        with open(os.path.join(shared, name), "rb") as f:
            assert f.read() == blob, name


def test_R6_negative_data_offsets_allocate_nothing(child_results):
    # was: a 1 GiB table allocated and written, then OSError EINVAL from pread
    check_refused(child_results["R6_neg_offsets_1GiB.safetensors"], ValueError, "'weight'", "data_offsets",
                  "non-negative")


def test_R6b_negative_data_offsets_never_read_the_header_as_rows(child_results):
    # was: loaded the header's own bytes as a [2, 4] table
    check_refused(child_results["R6b_neg_offsets_reads_header.safetensors"], ValueError, "'weight'", "data_offsets")


@pytest.mark.parametrize("name", ["R7_str_in_shape.safetensors", "R7_str_in_shape.npy"])
def test_R7_string_in_shape_is_a_type_error_of_the_field_not_a_huge_string(child_results, name):
    # was: 'a' * 300000000 * 4 built as a number of bytes: 2.5 GB peak and a 1.2 GB message
    check_refused(child_results[name], ValueError, "shape", "non-negative int")


def test_R8_npy_header_length_is_capped_before_reading(child_results):
    # was: a 4 GiB read buffer requested (MemoryError under the address-space limit)
    check_refused(child_results["R8_npy_header_len_4GiB.npy"], ValueError, "header length", "4294967295")


def test_R9_pt_record_size_is_checked_against_the_file_before_torch_reads_it(child_results):
    check_refused(child_results["R9_pt_record_size_4GiB.pt"], ValueError, "byteorder", "4294967295")


def test_R9_torch_load_is_not_called_for_an_oversized_record(tmp_path, monkeypatch):
    path = tmp_path / "r9.pt"
    path.write_bytes(r9_bytes(tmp_path))

    def no_load(*args, **kwargs):
        raise AssertionError("torch.load ran on an archive whose record claims more than the file")

    monkeypatch.setattr(torch, "load", no_load)
    with pytest.raises(ValueError, match=r"record 'r9_src/byteorder' claims 4294967295 bytes"):
        hostembed.Embedding.from_pretrained(path)


R12 = [
    ("R12_deep_json.safetensors", ValueError, ["nest"]),
    ("R12_json_not_object.safetensors", ValueError, ["JSON object"]),
    ("R12_missing_shape.safetensors", ValueError, ["'weight'", "'shape'", "missing"]),
    ("R12_offsets_3.safetensors", ValueError, ["'weight'", "data_offsets", "2"]),
    ("R12_shape_list_dtype.safetensors", ValueError, ["'weight'", "dtype", "['F32']"]),
    ("R12_npy_truncated_len.npy", ValueError, ["truncated", "header length"]),
    ("R12_npy_descr_list.npy", TypeError, ["descr", "['<f4']", "unsupported dtype"]),
]


@pytest.mark.parametrize("name,exc_type,fragments", R12, ids=[r[0] for r in R12])
def test_R12_malformed_headers_raise_the_documented_type_naming_the_field(child_results, name, exc_type, fragments):
    # was: RecursionError, AttributeError, KeyError 'shape', ValueError "too many values to
    # unpack", TypeError unhashable, struct.error
    check_refused(child_results[name], exc_type, *fragments)


@pytest.mark.parametrize("name,fragments", [
    ("broadcast_view.pt", ["'weight'", "storage"]),
    ("broadcast_view_1GiB.pt", ["'weight'", "storage"]),
    ("meta.pt", ["'weight'", "meta"]),
    ("deep_state_dict.pt", ["nested"]),
])
def test_pt_tensors_that_claim_more_than_the_file_holds(child_results, name, fragments):
    # was: a table of the claimed size allocated (MemoryError / 1 GiB filled), or RecursionError
    check_refused(child_results[name], ValueError, *fragments)


def test_pt_state_dict_that_contains_itself_loads_its_tensor(child_results):
    # was: RecursionError from flattening the cycle
    assert child_results["cyclic_state_dict.pt"]["loaded"] == [3, 2]


def test_compressed_pt_record_is_refused_not_read_as_raw_bytes(tmp_path):
    # torch.load(mmap=True) maps a deflated storage record as if it were raw
    # data (torch 2.x): the table was silently filled with compressed bytes.
    source = tmp_path / "plain.pt"
    torch.save({"weight": torch.randn(50, 8)}, source)
    path = tmp_path / "deflated.pt"
    with zipfile.ZipFile(source) as z, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
        for info in z.infolist():
            out.writestr(info.filename, z.read(info.filename))
    with pytest.raises(ValueError, match=r"record '.*' is compressed"):
        hostembed.Embedding.from_pretrained(path)


def test_pt_storage_must_be_exactly_its_record(tmp_path):
    # fuzz finding: torch.load(mmap=True) takes the pickle's storage size
    # without comparing it with the record's (without mmap torch refuses).
    data = struct.pack("<7f", *range(7))
    path = write_pt(tmp_path / "recsize.pt", state_dict_pickle({"weight": tensor_pickle_ops()}), {"0": data})
    assert torch.load(path, mmap=True, weights_only=True)["weight"].shape == (3, 2)
    with pytest.raises(ValueError, match=r"key 'weight' has a storage of 24 bytes .* record 'archive/data/0' holds "
                                         r"28 bytes"):
        hostembed.Embedding.from_pretrained(path)


def test_pt_record_offsets_outside_the_file(tmp_path):
    # fuzz finding: a central directory offset past its real place makes
    # Python's zipfile report negative record offsets (then os.pread: EINVAL).
    path = write_pt(tmp_path / "ok.pt", state_dict_pickle({"weight": tensor_pickle_ops()}),
                    {"0": struct.pack("<6f", *range(6))})
    blob = bytearray(open(path, "rb").read())
    end = blob.rfind(b"PK\x05\x06")
    struct.pack_into("<I", blob, end + 16, struct.unpack_from("<I", blob, end + 16)[0] + 1000)
    (tmp_path / "negative.pt").write_bytes(blob)
    # (refused now by the check that zipfile and torch read the same central directory)
    with pytest.raises(ValueError, match=r"central directory is at byte 514, but its end record says byte 1514"):
        hostembed.Embedding.from_pretrained(tmp_path / "negative.pt")


@pytest.mark.parametrize("field,value", [("external_attr", 0x10), ("flag_bits", 0x1)], ids=["directory", "encrypted"])
def test_pt_record_marked_as_directory_or_encrypted(tmp_path, field, value):
    # fuzz finding: a storage record whose DOS attributes say "directory"
    # (0xfffa): torch.load without mmap returned uninitialised memory as its
    # data (miniz extracts a directory as nothing), with mmap the bytes in
    # the file. Two readers, two tables: refused.
    path = write_pt(tmp_path / "ok.pt", state_dict_pickle({"weight": tensor_pickle_ops()}),
                    {"0": struct.pack("<6f", *range(6))})
    blob = bytearray(open(path, "rb").read())
    pos = blob.find(b"PK\x01\x02")
    while blob[pos + 46:pos + 46 + 14] != b"archive/data/0":  # its central directory entry
        pos = blob.find(b"PK\x01\x02", pos + 4)
    if field == "external_attr":
        struct.pack_into("<I", blob, pos + 38, 0x0180FFFA)
    else:
        struct.pack_into("<H", blob, pos + 8, value)
    (tmp_path / "marked.pt").write_bytes(blob)
    with pytest.raises(ValueError, match=r"record 'archive/data/0' is marked as a directory or as encrypted"):
        hostembed.Embedding.from_pretrained(tmp_path / "marked.pt")


def test_pt_data_before_the_archive(tmp_path):
    # Python's zipfile shifts every offset by the bytes before the archive,
    # torch's reader does not: they would read different records.
    path = write_pt(tmp_path / "ok.pt", state_dict_pickle({"weight": tensor_pickle_ops()}),
                    {"0": struct.pack("<6f", *range(6))})
    (tmp_path / "prepended.pt").write_bytes(b"\0" * 100 + open(path, "rb").read())
    with pytest.raises(ValueError, match=r"central directory is at byte \d+, but its end record says byte \d+"):
        hostembed.Embedding.from_pretrained(tmp_path / "prepended.pt")


def test_zip64_pt_still_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 1)  # makes zipfile write the zip64 end records
    path = write_pt(tmp_path / "z64.pt", state_dict_pickle({"weight": tensor_pickle_ops()}),
                    {"0": struct.pack("<6f", *range(6))})
    monkeypatch.undo()
    assert b"PK\x06\x06" in open(path, "rb").read()
    assert torch.equal(hostembed.Embedding.from_pretrained(path).weight.detach(), torch.arange(6.0).view(3, 2))


def test_legacy_torch_save_format_says_so(tmp_path):
    torch.save({"weight": torch.ones(3, 2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match=r"not a valid zip archive .* legacy format"):
        hostembed.Embedding.from_pretrained(tmp_path / "old.pt")


def test_big_endian_pt_gives_torch_loads_values(tmp_path):
    # torch byteswaps a big-endian archive's storages in its private mapping;
    # hostembed then pread the file's unswapped bytes.
    values = struct.pack(">6f", *(float(i) + 0.5 for i in range(6)))
    path = write_pt(tmp_path / "be.pt", state_dict_pickle({"weight": tensor_pickle_ops()}), {"0": values},
                    byteorder=b"big")
    expected = torch.load(path, mmap=True, weights_only=True)["weight"]
    assert torch.equal(expected, torch.arange(6.0).view(3, 2) + 0.5)
    assert torch.equal(hostembed.Embedding.from_pretrained(path).weight.detach(), expected)


def test_messages_stay_short_with_many_or_long_keys(tmp_path):
    tensors = {f"{'k' * 300}{i}": torch.zeros(2, 2) for i in range(2000)}
    path = str(tmp_path / "many.safetensors")
    save_file(tensors, path)
    with pytest.raises(KeyError) as info:
        hostembed.Embedding.from_pretrained(path, key="absent")
    assert len(str(info.value)) <= MESSAGE_LIMIT + 200 and "2000 keys" in str(info.value)
    with pytest.raises(ValueError) as info:
        hostembed.Embedding.from_pretrained(path)
    assert len(str(info.value)) <= MESSAGE_LIMIT + 200 and "several 2-D float tensors" in str(info.value)
    header = {"weight": {"dtype": "F32", "shape": list(range(1, 5000)), "data_offsets": [0, 4]}}
    (tmp_path / "longshape.safetensors").write_bytes(safetensors_bytes(header, b"\0" * 4))
    with pytest.raises(ValueError) as info:
        hostembed.Embedding.from_pretrained(tmp_path / "longshape.safetensors")
    assert len(str(info.value)) <= MESSAGE_LIMIT


# -- malformed headers, one field at a time --------------------------------

def st_entry(**fields):
    entry = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    entry.update(fields)
    return {"weight": {k: v for k, v in entry.items() if v is not None}}


@pytest.mark.parametrize("header,payload,exc_type,pattern", [
    (st_entry(data_offsets=[0, 20]), 24, ValueError, r"'weight' field 'data_offsets'.*24"),
    (st_entry(data_offsets=[8, 32]), 32, ValueError, r"data_offsets.*start at byte 0"),
    (st_entry(data_offsets=[0, 2 ** 64]), 24, ValueError, r"data_offsets"),
    (st_entry(shape=[2, -3]), 24, ValueError, r"'weight' field 'shape'.*non-negative"),
    (st_entry(shape=[2, True]), 24, ValueError, r"'weight' field 'shape'"),
    (st_entry(shape=[2.0, 3]), 24, ValueError, r"'weight' field 'shape'"),
    (st_entry(shape=[2 ** 40, 2 ** 40, 0], data_offsets=[0, 0]), 0, ValueError, r"'weight' field 'shape'.*overflow"),
    (st_entry(dtype="F31"), 24, ValueError, r"'weight' field 'dtype'.*'F31'"),
    (st_entry(dtype="I32"), 24, TypeError, r"unsupported dtype I32"),
    (st_entry(data_offsets=None), 24, ValueError, r"'weight'.*missing field 'data_offsets'"),
    (st_entry(), 25, ValueError, r"1 bytes after its last tensor"),
    (st_entry(), 23, ValueError, r"truncated"),
    ({"weight": [1, 2]}, 0, ValueError, r"'weight'.*expected a JSON object"),
    ({"__metadata__": {"a": 1}, **st_entry()}, 24, ValueError, r"__metadata__.*string"),
    (b'{"weight": {"dtype": "F32", "dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}', 24, ValueError,
     r"duplicate key 'dtype'"),
    (b'{"weight": {"dtype": "F32", "shape": [2, NaN], "data_offsets": [0, 24]}}', 24, ValueError, r"NaN"),
    (b'{"\xff": 1}', 0, ValueError, r"UTF-8"),
    (b'{"weight": {"dtype": "F32", "shape": [[[[[[[[[[[[[[[[[[[2]]]]]]]]]]]]]]]]]]], "data_offsets": [0, 8]}}', 8,
     ValueError, r"nest"),
], ids=[
    'offsets_span', 'offsets_gap', 'offsets_2to64', 'shape_negative', 'shape_bool', 'shape_float',
    'shape_overflow', 'dtype_unknown', 'dtype_int', 'missing_offsets', 'trailing_byte', 'truncated',
    'entry_list', 'metadata_int', 'duplicate_field', 'nan', 'not_utf8', 'deep_shape',
])
def test_safetensors_field_errors(tmp_path, header, payload, exc_type, pattern):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(safetensors_bytes(header, b"\0" * payload))
    with pytest.raises(exc_type, match=pattern) as info:
        hostembed.Embedding.from_pretrained(path, key="weight")
    assert "bad.safetensors" in str(info.value) and len(str(info.value)) <= MESSAGE_LIMIT


def test_safetensors_header_length_beyond_the_file_or_the_cap(tmp_path):
    path = tmp_path / "long.safetensors"
    path.write_bytes(struct.pack("<Q", 200) + b"{}")
    with pytest.raises(ValueError, match="header length 200 .* file has 10 bytes"):
        hostembed.Embedding.from_pretrained(path)
    path.write_bytes(struct.pack("<Q", 2 ** 63) + b"{}")
    with pytest.raises(ValueError, match="header length 9223372036854775808 exceeds"):
        hostembed.Embedding.from_pretrained(path)


@pytest.mark.parametrize("header,exc_type,pattern", [
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", ValueError, r"'shape'.*non-negative"),
    ("{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3), }", ValueError, r"'fortran_order'.*True or False"),
    ("{'descr': '<f4', 'shape': (2, 3), }", ValueError, r"keys.*'descr', 'fortran_order', 'shape'"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}", ValueError, r"keys"),
    ("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", TypeError, r"unsupported dtype '>f4'"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': " + "(" * 50 + ")" * 50 + "}", ValueError, r"nest"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, " + "-" * 5000 + "3), }", ValueError, r"header"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3" + "0" * 4000 + "), }", ValueError, r"shape"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, __import__('os')), }", ValueError, r"header"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (2 ** 64, 1), }", ValueError, r"header"),
    ("{[1]: 2}", ValueError, r"header"),
    ("[1, 2]", ValueError, r"dict"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), ", ValueError, r"header"),
], ids=[
    'shape_negative', 'fortran_int', 'missing_key', 'extra_key', 'big_endian', 'deep_parens', 'many_minus',
    'long_int', 'call', 'power', 'unhashable_key', 'list', 'unclosed',
])
def test_npy_field_errors(tmp_path, header, exc_type, pattern):
    path = tmp_path / "bad.npy"
    path.write_bytes(npy_bytes(header, b"\0" * 24))
    with pytest.raises(exc_type, match=pattern) as info:
        hostembed.Embedding.from_pretrained(path)
    assert "bad.npy" in str(info.value) and len(str(info.value)) <= MESSAGE_LIMIT


def test_npy_versions_and_caps(tmp_path):
    path = tmp_path / "v.npy"
    path.write_bytes(b"\x93NUMPY\x04\x00" + b"\0" * 64)
    with pytest.raises(ValueError, match=r"version 4.0, expected 1.0, 2.0 or 3.0"):
        hostembed.Embedding.from_pretrained(path)
    path.write_bytes(b"\x93NUMPY\x02\x00" + struct.pack("<I", 20000) + b" " * 20000)
    with pytest.raises(ValueError, match=r"header length 20000 exceeds 10000"):
        hostembed.Embedding.from_pretrained(path)


def test_not_a_regular_file(tmp_path):
    fifo = tmp_path / "pipe.npy"
    os.mkfifo(fifo)
    # Opening a FIFO for reading blocks until a writer comes: one comes after
    # a while, so a reader that opened it fails this test instead of hanging.
    def unblock():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader: nothing to unblock
            pass

    writer = threading.Timer(5.0, unblock)
    writer.start()
    try:
        with pytest.raises(ValueError, match="not a regular file"):
            hostembed.Embedding.from_pretrained(fifo)
    finally:
        writer.cancel()


# -- valid files still load, bit for bit ----------------------------------

def test_valid_npy_of_every_header_version(tmp_path):
    table = np.random.default_rng(0).standard_normal((37, 5)).astype(np.float32)
    for version in ((1, 0), (2, 0), (3, 0)):
        path = tmp_path / f"v{version[0]}.npy"
        with open(path, "wb") as f:
            np.lib.format.write_array(f, table, version=version)
        assert torch.equal(hostembed.Embedding.from_pretrained(path).weight.detach(), torch.from_numpy(table))


def test_valid_safetensors_with_metadata_and_every_dtype_beside_the_table(tmp_path):
    table = torch.randn(41, 6)
    others = {"b": torch.zeros(3, dtype=torch.bool), "u8": torch.arange(5, dtype=torch.uint8),
              "i64": torch.arange(7), "f8": torch.zeros(4, dtype=torch.float8_e4m3fn), "empty": torch.zeros(0, 9),
              "bf": torch.ones(2, 3, dtype=torch.bfloat16).view(6)}
    path = str(tmp_path / "mixed.safetensors")
    save_file({"weight": table, **others}, path, metadata={"format": "pt", "note": "x" * 1000})
    assert torch.equal(hostembed.Embedding.from_pretrained(path).weight.detach(), table)


def test_valid_pt_views_and_nested_state_dicts(tmp_path):
    big = torch.randn(40, 7)
    path = tmp_path / "view.pt"
    torch.save({"model": {"emb": {"weight": big[5:25]}}, "step": 3}, path)
    assert torch.equal(hostembed.Embedding.from_pretrained(path, key="model.emb.weight").weight.detach(), big[5:25])
    torch.save({"weight": big.t()}, path)  # strided: copied through the mapping
    assert torch.equal(hostembed.Embedding.from_pretrained(path).weight.detach(), big.t())
    data = struct.pack("<6f", *range(6))
    built = write_pt(tmp_path / "built.pt", state_dict_pickle({"weight": tensor_pickle_ops()}), {"0": data})
    assert torch.equal(hostembed.Embedding.from_pretrained(built).weight.detach(), torch.arange(6.0).view(3, 2))


# -- what hostembed accepts, the formats' own readers accept ---------------

def _json_values():
    scalars = st.one_of(st.integers(-2 ** 65, 2 ** 65), st.booleans(), st.none(), st.text(max_size=4),
                        st.floats(allow_nan=False, allow_infinity=False))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=3), inner, max_size=2), max_leaves=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["dtype", "shape", "data_offsets", "extra"]), value=_json_values(),
       payload_delta=st.sampled_from([0, 0, 0, -4, 4]), second=st.booleans())
def test_safetensors_acceptance_agrees_with_the_safetensors_library(tmp_path, field, value, payload_delta, second):
    entry = {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 24]}
    entry[field] = value
    header = {"weight": entry}
    if second:
        header["other"] = {"dtype": "I16", "shape": [2], "data_offsets": [24, 28]}
    payload = bytes(range(24)) + (b"\1\2\3\4" if second else b"")
    payload = payload[:len(payload) + payload_delta] if payload_delta < 0 else payload + b"\0" * payload_delta
    path = str(tmp_path / "h.safetensors")
    with open(path, "wb") as f:
        f.write(safetensors_bytes(header, payload))
    try:
        got = hostembed.Embedding.from_pretrained(path, key="weight").weight.detach()
    except (ValueError, TypeError, KeyError):
        return
    with safe_open(path, "pt") as f:  # raises if hostembed accepted what the library refuses
        expected = f.get_tensor("weight")
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(descr=st.sampled_from(["'<f4'", "'<f2'", "'<f8'", "'>f4'", "'|f4'", "'<i4'", "['<f4']", "1"]),
       fortran=st.sampled_from(["False", "True", "0", "'x'"]),
       shape=st.lists(st.integers(-2, 7), max_size=3), extra=st.sampled_from(["", "'x': 1, "]),
       payload=st.integers(0, 200))
def test_npy_acceptance_agrees_with_numpy(tmp_path, descr, fortran, shape, extra, payload):
    shape_text = "(" + "".join(f"{d}, " for d in shape) + ")"
    header = f"{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape_text}, {extra}}}"
    path = str(tmp_path / "h.npy")
    with open(path, "wb") as f:
        f.write(npy_bytes(header, bytes(range(256))[:payload]))
    try:
        got = hostembed.Embedding.from_pretrained(path).weight.detach()
    except (ValueError, TypeError, KeyError):
        return
    expected = np.load(path, allow_pickle=False)  # raises if hostembed accepted what numpy refuses
    torch.testing.assert_close(got, torch.from_numpy(np.ascontiguousarray(expected)), rtol=0, atol=0,
                               equal_nan=True)
