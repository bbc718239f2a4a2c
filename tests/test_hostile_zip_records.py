"""torch.save archives whose zip records claim more than the file holds.

Fuzz finding: a 1.7 KB checkpoint whose 'data.pkl' record (or 'byteorder',
'version', any record torch.load reads into memory) claims 4 GiB made
hostembed.load allocate 4 GiB inside torch.load (its zip reader allocates
the size a record's central directory entry claims, then fails to read it)
before the ValueError came. Each forged file must now be refused, by
hostembed.load and by Embedding.from_pretrained(path), with hostembed's own
ValueError naming the file and the record, before torch.load runs. Sizes
forged in a local header only are refused too, though torch's reader takes
a record's sizes from the central directory (torch.load reads such a file):
two headers of one record that disagree make a forged archive.

Memory is measured in a child process: the growth of its peak RSS
(ru_maxrss) and of its peak address space (VmPeak). torch never touches the
buffer it allocated (the read fails first), so only VmPeak sees it (4 GiB
before the fix; ru_maxrss stays flat on Linux either way); both must stay
far below what the file claims.
"""
import json
import os
import re
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

import hostembed
from test_hostile_files import MiB, patch_record_sizes, state_dict_pickle, tensor_pickle_ops

CLAIM = 0xFFFFFFFF  # 4 GiB - 1: the largest size a zip record states without zip64
GROWTH_LIMIT = 512 * MiB
RECORDS = [b"data.pkl", b"byteorder", b"version"]
FORGERIES = {  # name -> (header, uncompressed_only)
    "central": ("central", False),
    "central_uncompressed": ("central", True),
    "local": ("local", False),
}


def checkpoint_bytes(tmp_path):
    """A checkpoint hostembed.load reads, written by torch.save (whose CRC-32s
    the table reader checked before this fix)."""
    torch.save({"model": hostembed.Embedding(6, 4).state_dict()}, tmp_path / "good.pt")
    return (tmp_path / "good.pt").read_bytes()


def forged_name(record, forgery):
    return f"{record.decode().replace('.', '_')}_{forgery}.pt"


_CHILD = r"""
import json, os, resource, sys
import torch, hostembed

def peaks():
    with open("/proc/self/status") as status:
        vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmPeak:"))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, vm

model = hostembed.Embedding(6, 4)
hostembed.load(sys.argv[1], model)  # warm up: lazy imports, the readers' threads
hostembed.Embedding.from_pretrained(sys.argv[1])
weights = model.weight.detach().clone()
rss, vm = peaks()
results = {}
# growth is measured from here, so the first file to allocate fails every
# later one too: from_pretrained, whose .pt reader checked the central
# directory before this fix, runs first
for reader in ("from_pretrained", "load"):
    for path in sys.argv[2:]:
        try:
            if reader == "load":
                hostembed.load(path, model)
            else:
                hostembed.Embedding.from_pretrained(path)
            res = {"loaded": True}
        except BaseException as exc:
            res = {"type": type(exc).__name__, "message": str(exc)[:2000]}
        now_rss, now_vm = peaks()
        res.update(rss_growth=now_rss - rss, vm_growth=now_vm - vm,
                   unchanged=torch.equal(model.weight.detach(), weights))
        results[f"{os.path.basename(path)} {reader}"] = res
        print(os.path.basename(path), reader, res, file=sys.stderr, flush=True)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def child_results(tmp_path_factory):
    """'<file> <reader>' -> result, for every forged file and both readers, from one child."""
    tmp_path = tmp_path_factory.mktemp("zip_records")
    good = checkpoint_bytes(tmp_path)
    paths = []
    for record in RECORDS:
        for forgery, (header, uncompressed_only) in FORGERIES.items():
            path = tmp_path / forged_name(record, forgery)
            path.write_bytes(patch_record_sizes(good, b"/" + record, CLAIM, header, uncompressed_only))
            paths.append(str(path))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "good.pt"), *paths], capture_output=True,
                           text=True, timeout=300, env=env)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("reader", ["load", "from_pretrained"])
@pytest.mark.parametrize("forgery", list(FORGERIES))
@pytest.mark.parametrize("record", RECORDS, ids=[r.decode() for r in RECORDS])
def test_record_claiming_4GiB_is_refused_before_torch_allocates_it(child_results, record, forgery, reader):
    name = forged_name(record, forgery)
    res = child_results[f"{name} {reader}"]
    assert "loaded" not in res, f"{reader} took a forged archive"
    assert res["vm_growth"] < GROWTH_LIMIT, f"peak address space grew by {res['vm_growth'] / MiB:.0f} MiB"
    assert res["rss_growth"] < GROWTH_LIMIT, f"peak RSS grew by {res['rss_growth'] / MiB:.0f} MiB"
    assert res["type"] == "ValueError", res
    message = res["message"]
    assert name in message and f"/{record.decode()}' claims {CLAIM} bytes" in message, message
    if forgery == "local":
        assert "in its local header" in message, message
    if reader == "load":
        assert message.startswith("hostembed.load: cannot read"), message
        assert res["unchanged"], "hostembed.load changed the model before refusing the file"


@pytest.mark.parametrize("record", RECORDS, ids=[r.decode() for r in RECORDS])
def test_hostembed_load_checks_the_records_before_torch_load(tmp_path, monkeypatch, record):
    path = tmp_path / "forged.pt"
    path.write_bytes(patch_record_sizes(checkpoint_bytes(tmp_path), b"/" + record, CLAIM))

    def no_load(*args, **kwargs):
        raise AssertionError("torch.load ran on an archive whose record claims more than the file")

    monkeypatch.setattr(torch, "load", no_load)
    pattern = (rf"'{re.escape(str(path))}' as a checkpoint .*record '[^']*/{record.decode()}' claims {CLAIM} bytes "
               rf"\({CLAIM} stored\) at byte \d+, the file has \d+ bytes")
    with pytest.raises(ValueError, match=pattern):
        hostembed.load(path, hostembed.Embedding(6, 4))


def test_record_running_past_the_end_of_the_file(tmp_path):
    # sizes that agree and fit after the record's offset, but not after its
    # name and padding: the data would run into (and past) the directory
    good = checkpoint_bytes(tmp_path)
    with zipfile.ZipFile(tmp_path / "good.pt") as z:
        offset = next(i.header_offset for i in z.infolist() if i.filename.endswith("/data.pkl"))
    claim = len(good) - offset - 30
    path = tmp_path / "past_the_end.pt"
    forged = patch_record_sizes(good, b"/data.pkl", claim)
    path.write_bytes(patch_record_sizes(forged, b"/data.pkl", claim, "local"))
    pattern = rf"'{re.escape(str(path))}' .*record '[^']*/data.pkl' of {claim} bytes at byte \d+ runs past the end of"
    with pytest.raises(ValueError, match=pattern):
        hostembed.load(path, hostembed.Embedding(6, 4))
    with pytest.raises(ValueError, match=pattern):
        hostembed.Embedding.from_pretrained(path)


def test_checkpoints_of_hostembed_save_and_torch_save_still_read(tmp_path):
    # hostembed.save writes no CRC-32s (torch.load checks none): the table
    # reader used to refuse its checkpoints for their 'byteorder' record
    model = hostembed.Embedding(6, 4)
    hostembed.save(tmp_path / "h.pt", model)
    torch.save({"weight": model.weight.detach()}, tmp_path / "t.pt")
    for name in ("h.pt", "t.pt"):
        table = hostembed.Embedding.from_pretrained(tmp_path / name)
        assert torch.equal(table.weight.detach(), model.weight.detach())
    target = hostembed.Embedding(6, 4)
    hostembed.load(tmp_path / "h.pt", target)
    assert torch.equal(target.weight.detach(), model.weight.detach())


def test_zip64_local_headers_are_read_for_their_sizes(tmp_path):
    # Python's zipfile (force_zip64) marks a local header's sizes 0xFFFFFFFF
    # and gives them in its zip64 field: those are the sizes compared
    path = tmp_path / "z64.pt"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in [("data.pkl", state_dict_pickle({"weight": tensor_pickle_ops()})), ("byteorder", b"little"),
                           ("data/0", struct.pack("<6f", *range(6))), ("version", b"3\n")]:
            with z.open(zipfile.ZipInfo(f"z64/{name}", date_time=(1980, 1, 1, 0, 0, 0)), "w", force_zip64=True) as out:
                out.write(data)
    good = path.read_bytes()
    zip64_at = 30 + struct.unpack_from("<H", good, 26)[0]  # data.pkl's local header is the first
    assert struct.unpack_from("<II", good, 18) == (CLAIM, CLAIM) and good[zip64_at:zip64_at + 2] == b"\x01\x00"
    assert torch.equal(hostembed.Embedding.from_pretrained(path).weight.detach(), torch.arange(6.0).view(3, 2))
    forged = bytearray(good)
    struct.pack_into("<Q", forged, zip64_at + 4, 1 << 32)  # its uncompressed size
    path.write_bytes(forged)
    with pytest.raises(ValueError, match=rf"record 'z64/data.pkl' claims {1 << 32} bytes \(\d+ stored\) in its local "
                                         r"header at byte 0, \d+ in the central directory"):
        hostembed.Embedding.from_pretrained(path)
