"""Builds tests/c/test_core.c against the C core under ASan + UBSan, and
again under ThreadSanitizer, and runs it.

The C program checks every core entry point against simple references (see
its header comment), including several program threads calling the core on
several tables at once while another changes the thread count; the
sanitizers add out-of-bounds accesses, use after free, leaks, undefined
behaviour and data races to what fails it. It needs only a C compiler, not
the built extension, so this test never imports hostembed.
"""
import os
import re
import shlex
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
TEST_SOURCE = REPO / "tests" / "c" / "test_core.c"

COMMON_CFLAGS = [
    "-std=c11",
    "-O1",
    "-g",
    "-fno-omit-frame-pointer",
    # The SparseAdam check is bit for bit against a reference that rounds
    # every float operation separately, as the core's build does.
    "-ffp-contract=off",
    "-fno-math-errno",
    "-pthread",
    "-Wall",
    "-Wextra",
    "-Wno-missing-field-initializers",
    # The core sees include/ (shared with the kernels) and its own csrc/,
    # never cuda/ nor binding/.
    f"-I{REPO / 'include'}",
    f"-I{CSRC}",
]
ASAN_CFLAGS = [
    "-fsanitize=address,undefined",
    # Make UB fatal: by default UBSan reports and carries on, exit status 0.
    "-fno-sanitize-recover=undefined",
]
# simd.h leaves target_clones out under any sanitizer (its ifunc resolvers
# run before the runtime is up); -DHE_NO_CLONES says so for compilers that
# do not define __SANITIZE_THREAD__.
TSAN_CFLAGS = ["-fsanitize=thread", "-DHE_NO_CLONES"]

SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$")

# What LeakSanitizer prints when it cannot run at all (under ptrace, or in a
# sandbox that hides /proc or forbids the stop-the-world it needs); that is
# the environment, not a leak.
LSAN_UNSUPPORTED = (
    "LeakSanitizer has encountered a fatal error",
    "LeakSanitizer does not work under ptrace",
)


def _compiler():
    """$CC if set (possibly with arguments, e.g. "ccache gcc"), else the first
    of cc, gcc, clang on PATH; None if there is none."""
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    return None


def _core_sources():
    # module.c is the CPython binding: it needs Python.h and is not tested here.
    return sorted(str(p) for p in CSRC.glob("*.c") if p.name != "module.c")


def _run(binary, detect_leaks):
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = f"detect_leaks={detect_leaks}:abort_on_error=0:strict_string_checks=1"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    # ASan must be the first runtime loaded; a preloaded library (a profiler,
    # a sandbox shim) would make it refuse to start.
    env.pop("LD_PRELOAD", None)
    return subprocess.run(
        [str(binary)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )


def _build(cc, flags, binary):
    cmd = [*cc, *COMMON_CFLAGS, *flags, str(TEST_SOURCE), *_core_sources(), "-lm", "-o", str(binary)]
    # A compiler that exists but fails (a compile error, no libasan or
    # libtsan) is a failure, not a skip.
    try:
        build = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    except FileNotFoundError as e:  # $CC names a program that is not there
        pytest.fail(f"compiler {cc[0]!r} not found: {e}")
    assert build.returncode == 0, f"compile failed:\n$ {shlex.join(cmd)}\n{build.stdout}"


def _check_output(result, what):
    output = result.stdout
    assert result.returncode == 0, f"test_core ({what}) exited with {result.returncode}:\n{output}"
    lines = output.strip().splitlines()
    assert lines, "test_core printed nothing"
    summary = SUMMARY.match(lines[-1])
    assert summary, f"last line is not 'N passed, M failed':\n{output}"
    passed, failed = map(int, summary.groups())
    assert failed == 0, output
    assert passed > 0, output
    return output


def test_core_under_sanitizers(tmp_path):
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler found ($CC unset and none of cc, gcc, clang on PATH)")

    binary = tmp_path / "test_core"
    _build(cc, ASAN_CFLAGS, binary)

    result = _run(binary, detect_leaks=1)
    if result.returncode != 0 and any(m in result.stdout for m in LSAN_UNSUPPORTED):
        # Leak checking cannot work in this environment; still run everything
        # else under ASan and UBSan rather than fail for the environment.
        warnings.warn("LeakSanitizer unsupported here; ran with detect_leaks=0")
        result = _run(binary, detect_leaks=0)
    _check_output(result, "ASan + UBSan")


# What ThreadSanitizer prints when the kernel's address-space layout is one
# its runtime cannot use (high mmap randomisation on newer kernels with an
# older runtime); the same binary runs with randomisation off.
TSAN_LAYOUT = ("unexpected memory mapping", "ThreadSanitizer: failed to")


def _run_tsan(binary):
    env = dict(os.environ)
    # Any race, lock-order inversion or misuse of a mutex fails the run.
    env["TSAN_OPTIONS"] = "halt_on_error=1:exitcode=66:second_deadlock_stack=1:history_size=4"
    env.pop("LD_PRELOAD", None)
    run = lambda argv: subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      timeout=300)
    result = run([str(binary)])
    if result.returncode != 0 and any(m in result.stdout for m in TSAN_LAYOUT) and shutil.which("setarch"):
        warnings.warn("ThreadSanitizer could not map its shadow memory; ran with address randomisation off")
        result = run(["setarch", os.uname().machine, "-R", str(binary)])
    return result


def test_core_under_thread_sanitizer(tmp_path):
    """The same program under TSan: its thread pool tests, and its
    concurrency group (4 program threads on 4 tables and one shared table,
    gather/renorm/grad_reduce/SparseAdam, while another thread keeps calling
    he_set_num_threads; results bit-identical to a serial run)."""
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler found ($CC unset and none of cc, gcc, clang on PATH)")
    binary = tmp_path / "test_core_tsan"
    _build(cc, TSAN_CFLAGS, binary)
    output = _check_output(_run_tsan(binary), "ThreadSanitizer")
    assert "ThreadSanitizer" not in output, output
    assert re.search(r"^concurrency\s+ok$", output, re.M), output


FUZZ_RUN = REPO / "fuzz" / "core" / "run.sh"
FUZZ_STATS = re.compile(r"^stat::number_of_executed_units:\s+(\d+)$", re.M)


def test_core_fuzz_harness_short_run(tmp_path):
    """fuzz/core/fuzz_core.c (libFuzzer + ASan + UBSan, no Python) over the
    seed corpus and 10 s of new inputs, written to a temporary directory:
    every entry point against the harness's naive references. Needs clang
    (.ci/run installs it); fuzz/core/run.sh SECONDS runs it for longer."""
    clang = os.environ.get("HOSTEMBED_FUZZ_CC", "clang")
    if shutil.which(clang) is None:
        pytest.skip("clang not found (libFuzzer comes with clang only; .ci/run installs it)")
    env = dict(os.environ, CC=clang, TMPDIR=str(tmp_path), FUZZ_BUILD=str(tmp_path / "build"),
               FUZZ_NEW_INPUTS=str(tmp_path / "new"), FUZZ_ARTIFACTS=str(tmp_path / "artifacts"))
    env.pop("LD_PRELOAD", None)
    result = subprocess.run(["bash", str(FUZZ_RUN), "10"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=300)
    output = result.stdout
    assert result.returncode == 0, f"fuzz/core/run.sh exited with {result.returncode}:\n{output[-6000:]}"
    executed = FUZZ_STATS.search(output)
    assert executed and int(executed.group(1)) > 1000, output[-3000:]
    assert not list((tmp_path / "artifacts").iterdir())
