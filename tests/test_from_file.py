"""Embedding.from_pretrained(path): every format and dtype, key choice, bad files."""
import os
import pathlib

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import hostembed
from hostembed.io import stream as _stream

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def table(rows=301, dim=12, seed=0):
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))


def write(fmt, path, tensor, key="weight"):
    """Writes `tensor` in format fmt; returns the path."""
    if fmt == "npy":
        # numpy has no bfloat16: those cases are covered by the other formats.
        np.save(path, tensor.numpy())
    elif fmt == "safetensors":
        save_file({key: tensor.contiguous(), "bias": torch.zeros(3)}, path)
    elif fmt == "pt-tensor":
        torch.save(tensor, path)
    elif fmt == "pt-state_dict":
        torch.save({key: tensor, "bias": torch.zeros(3)}, path)
    return path


CASES = [(fmt, dtype) for fmt in ("npy", "safetensors", "pt-tensor", "pt-state_dict") for dtype in DTYPES
         if not (fmt == "npy" and dtype == torch.bfloat16)]


@pytest.mark.parametrize("fmt,dtype", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_loads_every_format_and_dtype_keeping_the_dtype(tmp_path, fmt, dtype, threads):
    source = table().to(dtype)
    suffix = ".npy" if fmt == "npy" else ".safetensors" if fmt == "safetensors" else ".pt"
    path = write(fmt, str(tmp_path / f"t{suffix}"), source)
    emb = hostembed.Embedding.from_pretrained(path)
    assert emb.weight.shape == source.shape
    # The file's dtype, read straight into the table: the same bits.
    assert emb.weight.dtype == dtype
    assert torch.equal(emb.weight.detach(), source)
    assert not emb.weight.requires_grad  # freeze=True, as torch's from_pretrained


def test_streams_in_many_chunks_across_threads(tmp_path, monkeypatch, threads):
    # A tiny chunk size makes every row boundary and the ragged last chunk count.
    monkeypatch.setattr(_stream, "CHUNK_BYTES", 3 * 12 * 4 + 5)
    source = table(1001)
    for fmt, suffix in (("npy", ".npy"), ("safetensors", ".safetensors"), ("pt-tensor", ".pt")):
        for dtype in (torch.float32, torch.float16):
            path = write(fmt, str(tmp_path / f"c{suffix}"), source.to(dtype))
            emb = hostembed.Embedding.from_pretrained(path)
            assert emb.weight.dtype == dtype and torch.equal(emb.weight.detach(), source.to(dtype)), (fmt, dtype)


def test_accepts_pathlike_and_options(tmp_path):
    path = pathlib.Path(write("npy", str(tmp_path / "t.npy"), table()))
    emb = hostembed.Embedding.from_pretrained(path, freeze=False, padding_idx=2, max_norm=1.5, sparse=True)
    assert emb.weight.requires_grad and emb.padding_idx == 2 and emb.max_norm == 1.5
    assert torch.equal(emb.weight.detach(), table())  # like torch: the padding row is kept as loaded


def test_key_picks_an_entry_and_nested_mappings_use_dotted_keys(tmp_path):
    a, b = table(seed=1), table(seed=2)
    path = str(tmp_path / "two.pt")
    torch.save({"model": {"users.weight": a, "items.weight": b}, "epoch": 3}, path)
    assert torch.equal(hostembed.Embedding.from_pretrained(path, key="model.items.weight").weight, b)
    st = str(tmp_path / "two.safetensors")
    save_file({"users": a, "items": b}, st)
    assert torch.equal(hostembed.Embedding.from_pretrained(st, key="users").weight, a)


def test_default_key_is_the_only_2d_float_tensor_else_weight(tmp_path):
    only = str(tmp_path / "only.pt")
    torch.save({"ids": torch.arange(6).view(2, 3), "emb": table(), "scale": torch.ones(4)}, only)
    assert torch.equal(hostembed.Embedding.from_pretrained(only).weight, table())
    both = str(tmp_path / "both.safetensors")
    save_file({"weight": table(seed=5), "other": table(seed=6)}, both)
    assert torch.equal(hostembed.Embedding.from_pretrained(both).weight, table(seed=5))


def test_ambiguous_file_asks_for_a_key(tmp_path):
    path = str(tmp_path / "amb.safetensors")
    save_file({"a": table(), "b": table()}, path)
    with pytest.raises(ValueError, match=r"several 2-D float tensors \['a', 'b'\]; pass key="):
        hostembed.Embedding.from_pretrained(path)


def test_missing_key_lists_the_keys(tmp_path):
    path = write("pt-state_dict", str(tmp_path / "t.pt"), table())
    with pytest.raises(KeyError, match=r"no key 'wieght'.*\['bias', 'weight'\]"):
        hostembed.Embedding.from_pretrained(path, key="wieght")
    st = write("safetensors", str(tmp_path / "t.safetensors"), table())
    with pytest.raises(KeyError, match=r"no key 'x'.*\['bias', 'weight'\]"):
        hostembed.Embedding.from_pretrained(st, key="x")


def test_path_that_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file: .*missing.npy"):
        hostembed.Embedding.from_pretrained(str(tmp_path / "missing.npy"))


def test_unknown_suffix_names_the_supported_ones(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=r"suffix '.bin': expected one of .pt, .pth, .safetensors, .npy"):
        hostembed.Embedding.from_pretrained(str(path))


@pytest.mark.parametrize("fmt,suffix", [("npy", ".npy"), ("safetensors", ".safetensors"), ("pt-tensor", ".pt")])
def test_truncated_file(tmp_path, fmt, suffix):
    path = write(fmt, str(tmp_path / f"t{suffix}"), table())
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match="truncated|cannot read"):
        hostembed.Embedding.from_pretrained(path)


def test_unsupported_dtypes(tmp_path):
    np.save(tmp_path / "i.npy", np.arange(12, dtype=np.int64).reshape(3, 4))
    with pytest.raises(TypeError, match=r"unsupported dtype '<i8'.*expected little-endian float16, float32"):
        hostembed.Embedding.from_pretrained(str(tmp_path / "i.npy"))
    save_file({"weight": torch.arange(12, dtype=torch.int32).view(3, 4)}, str(tmp_path / "i.safetensors"))
    with pytest.raises(TypeError, match="unsupported dtype I32 .*expected one of F32, F16, BF16, F64"):
        hostembed.Embedding.from_pretrained(str(tmp_path / "i.safetensors"), key="weight")
    torch.save(torch.zeros(3, 4, dtype=torch.complex64), str(tmp_path / "c.pt"))
    with pytest.raises(TypeError, match="unsupported dtype torch.complex64.*float32, float16, bfloat16, float64"):
        hostembed.Embedding.from_pretrained(str(tmp_path / "c.pt"))


def test_not_2d_gives_the_shape(tmp_path):
    torch.save(torch.zeros(2, 3, 4), str(tmp_path / "3d.pt"))
    with pytest.raises(ValueError, match=r"expected a 2-D table .* found shape \[2, 3, 4\]"):
        hostembed.Embedding.from_pretrained(str(tmp_path / "3d.pt"))


def test_fortran_order_npy_is_refused_with_the_fix(tmp_path):
    np.save(tmp_path / "f.npy", np.asfortranarray(np.ones((5, 3), dtype=np.float32)))
    with pytest.raises(ValueError, match="Fortran .*ascontiguousarray"):
        hostembed.Embedding.from_pretrained(str(tmp_path / "f.npy"))


def test_not_a_file_format_at_all(tmp_path):
    (tmp_path / "junk.npy").write_bytes(b"hello, this is not numpy")
    with pytest.raises(ValueError, match="not a .npy file"):
        hostembed.Embedding.from_pretrained(str(tmp_path / "junk.npy"))
    (tmp_path / "junk.pt").write_bytes(b"hello, this is not a zip archive")
    with pytest.raises(ValueError, match="cannot read .* as a torch.save file"):
        hostembed.Embedding.from_pretrained(str(tmp_path / "junk.pt"))
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(ValueError, match="malformed safetensors header"):
        hostembed.Embedding.from_pretrained(str(tmp_path / "junk.safetensors"))


def test_tensor_source_still_works_and_key_is_refused_for_it():
    emb = hostembed.Embedding.from_pretrained(table(), freeze=False)
    assert torch.equal(emb.weight.detach(), table()) and emb.weight.requires_grad
    with pytest.raises(ValueError, match="key= applies to files"):
        hostembed.Embedding.from_pretrained(table(), key="weight")
    with pytest.raises(TypeError, match="expects a 2-D tensor or a path"):
        hostembed.Embedding.from_pretrained([[1.0, 2.0]])


def test_torch_file_rows_are_read_from_the_file_and_strided_ones_copied(tmp_path):
    from hostembed.io.files import FileRows, open_table

    source = table()
    torch.save({"weight": source}, tmp_path / "c.pt")
    rows = open_table(tmp_path / "c.pt")
    assert isinstance(rows, FileRows) and rows.shape == tuple(source.shape)  # pread, not page faults
    # A transposed tensor is saved with its strides: rows are not contiguous
    # in the file, so it goes through the mapped tensor instead.
    torch.save({"weight": table(12, 301).t()}, tmp_path / "t.pt")
    assert isinstance(open_table(tmp_path / "t.pt"), torch.Tensor)
    emb = hostembed.Embedding.from_pretrained(tmp_path / "t.pt")
    assert torch.equal(emb.weight.detach(), table(12, 301).t())


def test_file_shrinking_under_the_reader_is_an_error_not_garbage(tmp_path, monkeypatch):
    from hostembed.io.files import FileRows

    monkeypatch.setattr(_stream, "CHUNK_BYTES", 1024)
    path = write("npy", str(tmp_path / "t.npy"), table())
    # As if the file lost its tail after its header was checked.
    claimed = FileRows(path, 128, (400, 12), torch.float32)
    with pytest.raises(ValueError, match="ended early: short read"):
        _stream.read_rows(claimed, torch.zeros(400, 12))
