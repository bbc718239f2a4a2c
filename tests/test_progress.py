"""Progress bars: a live bar on a terminal, a few plain lines in a log."""
import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import textwrap

import numpy as np
import pytest
import torch

import hostembed
from hostembed.io import stream as _stream

PERCENT = re.compile(r"(\d+)%")


def _lines(text):
    assert "\r" not in text, f"carriage returns in a non-terminal's output: {text[:300]!r}"
    assert text.endswith("\n"), f"the last progress line is not ended: {text[-200:]!r}"
    return text.splitlines()


def _percentages(lines):
    return [int(PERCENT.search(line).group(1)) for line in lines]


def _copy_many_chunks(monkeypatch):
    monkeypatch.setattr(_stream, "CHUNK_BYTES", 1024)  # 16 rows of 64 bytes: 625 chunks
    src = torch.randn(10_000, 16)
    dst = torch.empty_like(src)
    _stream.copy_rows(dst, src, progress=True, desc="copying rows")
    assert torch.equal(dst, src)


def test_a_fast_copy_logs_a_start_and_a_final_line(capsys, monkeypatch):
    _copy_many_chunks(monkeypatch)
    lines = _lines(capsys.readouterr().err)
    assert 2 <= len(lines) <= 12, lines
    assert lines[0].startswith("copying rows:") and " 0%" in lines[0], lines
    assert "100%" in lines[-1] and "625kB/625kB" in lines[-1], lines


def test_a_log_line_at_most_every_ten_percent_and_one_final(capsys, monkeypatch):
    monkeypatch.setattr(_stream, "LOG_PROGRESS_SECONDS", 0)  # as if each chunk took long
    _copy_many_chunks(monkeypatch)
    lines = _lines(capsys.readouterr().err)
    assert 10 <= len(lines) <= 12, lines
    percent = _percentages(lines)
    assert percent[0] == 0 and percent[-1] == 100, lines
    assert all(b - a >= 9 for a, b in zip(percent, percent[1:])), lines  # 10% of the bytes, rounded
    assert percent.count(100) == 1, lines


def test_exactly_ten_percent_chunks_give_one_final_line(capsys, monkeypatch):
    """The last chunk's refresh is at 100% already: the bar's closing
    refresh must not repeat it."""
    monkeypatch.setattr(_stream, "LOG_PROGRESS_SECONDS", 0)
    monkeypatch.setattr(_stream, "CHUNK_BYTES", 6400)
    src = torch.randn(1000, 16)
    _stream.copy_rows(torch.empty_like(src), src, progress=True)
    percent = _percentages(_lines(capsys.readouterr().err))
    assert percent == list(range(0, 101, 10)), percent


def test_loading_a_file_logs_lines_named_after_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(_stream, "CHUNK_BYTES", 1024)
    rows = np.random.default_rng(0).standard_normal((10_000, 16), dtype=np.float32)
    path = tmp_path / "rows.npy"
    np.save(path, rows)
    emb = hostembed.Embedding.from_pretrained(str(path), progress=True)
    assert torch.equal(emb.weight.detach(), torch.from_numpy(rows))
    lines = _lines(capsys.readouterr().err)
    assert 2 <= len(lines) <= 12, lines
    assert all(line.startswith("loading rows.npy:") for line in lines), lines
    assert "100%" in lines[-1], lines


@pytest.mark.parametrize("progress", [False, None])
def test_no_output_when_off_or_small(capsys, monkeypatch, progress):
    monkeypatch.setattr(_stream, "CHUNK_BYTES", 1024)
    src = torch.randn(10_000, 16)
    _stream.copy_rows(torch.empty_like(src), src, progress=progress)
    assert capsys.readouterr().err == ""


def test_a_terminal_still_gets_the_live_bar():
    code = textwrap.dedent("""
        import torch
        from hostembed.io import stream as _stream
        _stream.CHUNK_BYTES = 1024
        src = torch.randn(10_000, 16)
        _stream.copy_rows(torch.empty_like(src), src, progress=True, desc="copying rows")
    """)
    try:
        master, slave = pty.openpty()
    except OSError as e:
        pytest.skip(f"no pseudo-terminal here: {e}")
    # A fresh pty is 0 columns wide, where tqdm draws nothing.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with subprocess.Popen([sys.executable, "-c", code], stdout=slave, stderr=slave) as proc:
        os.close(slave)
        out = b""
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            out += data
        os.close(master)
    assert proc.returncode == 0, out.decode(errors="replace")
    text = out.decode(errors="replace")
    assert "\rcopying rows:" in text and "|" in text, repr(text[:300])  # redrawn in place, with a bar
