"""The extension exports one dynamic symbol, PyInit__C, and coexists with torch.

Anything else it exports is bound by libraries loaded after it: a build whose
static libstdc++ / cudart / CUB objects exported their C++ ABI (__cxa_*,
GNU_UNIQUE guard variables: 4,328 symbols) made `import hostembed; import
torch` segfault inside torch's import. setup.py hides everything with
-fvisibility=hidden, a version script (exports.map) and --exclude-libs,ALL.
"""
import struct
import subprocess
import sys
import textwrap

import pytest

from hostembed._core import _C

_SHT_DYNSYM = 11
_SHN_UNDEF, _SHN_ABS = 0, 0xFFF1
_STB_GLOBAL, _STB_WEAK, _STB_GNU_UNIQUE = 1, 2, 10
_STT_SECTION, _STT_FILE = 3, 4


def exported_symbols(path):
    """Names of the symbols a shared object defines for others to bind
    (global, weak or GNU_UNIQUE; not section/file symbols nor the ABS markers
    that name symbol versions), read from its .dynsym: a small ELF reader so
    the test needs no binutils."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF":
        pytest.skip(f"{path} is not an ELF file")
    is64 = data[4] == 2
    end = "<" if data[5] == 1 else ">"
    if is64:
        shoff, = struct.unpack_from(end + "Q", data, 0x28)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x3A)
        section = lambda i: struct.unpack_from(end + "IIQQQQIIQQ", data, shoff + i * shentsize)
        sym_fmt, sym_size = end + "IBBHQQ", 24        # name, info, other, shndx, value, size
    else:
        shoff, = struct.unpack_from(end + "I", data, 0x20)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x2E)
        section = lambda i: struct.unpack_from(end + "IIIIIIIIII", data, shoff + i * shentsize)
        sym_fmt, sym_size = end + "IIIBBH", 16        # name, value, size, info, other, shndx
    names = set()
    found = False
    for i in range(shnum):
        _, sh_type, _, _, offset, size, link, _, _, entsize = section(i)
        if sh_type != _SHT_DYNSYM:
            continue
        found = True
        strtab_offset = section(link)[4]
        for k in range(size // (entsize or sym_size)):
            fields = struct.unpack_from(sym_fmt, data, offset + k * (entsize or sym_size))
            if is64:
                st_name, info, _, shndx, _, _ = fields
            else:
                st_name, _, _, info, _, shndx = fields
            bind, kind = info >> 4, info & 0xF
            if shndx in (_SHN_UNDEF, _SHN_ABS) or kind in (_STT_SECTION, _STT_FILE):
                continue
            if bind not in (_STB_GLOBAL, _STB_WEAK, _STB_GNU_UNIQUE):
                continue
            stop = data.index(b"\0", strtab_offset + st_name)
            names.add(data[strtab_offset + st_name:stop].decode())
    if not found:
        pytest.skip(f"{path} has no section headers to find .dynsym by")
    return names


def test_the_extension_exports_only_its_init_function():
    if not sys.platform.startswith("linux"):
        pytest.skip("the export rules are the ELF linker's")
    names = exported_symbols(_C.__file__)
    extra = sorted(names - {"PyInit__C"})
    assert names == {"PyInit__C"}, (
        f"{_C.__file__} exports {len(names)} dynamic symbols, expected only PyInit__C; "
        f"e.g. {extra[:10]}")


LOOKUP = textwrap.dedent("""
    import torch, hostembed
    emb = hostembed.Embedding(10, 4)
    ids = torch.tensor([3, 1, 3])
    out = emb(ids)
    assert torch.equal(out, emb.weight.detach()[ids]), out
    out.sum().backward()
    print("ok")
""")


@pytest.mark.parametrize("first, second", [("hostembed", "torch"), ("torch", "hostembed")])
def test_imports_with_torch_in_either_order(first, second):
    code = f"import {first}\nimport {second}\n" + LOOKUP
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", (
        f"import {first}; import {second} exited with {res.returncode}\n{res.stdout}\n{res.stderr}")
