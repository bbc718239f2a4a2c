#!/usr/bin/env bash
# Builds fuzz/core/fuzz_core.c (libFuzzer + ASan + UBSan, the csrc/ sources,
# no Python) and runs it for SECONDS on the seed corpus fuzz/corpus/core/.
#
#   fuzz/core/run.sh [SECONDS] [libFuzzer options...]
#
# New inputs go to a temporary directory (FUZZ_NEW_INPUTS to choose one),
# never into the checked-in corpus; a crash or a failed check leaves its
# input under FUZZ_ARTIFACTS (default: that temporary directory) and makes
# this script exit non-zero. FUZZ_BUILD: where the binary goes; CC: the
# clang to use (libFuzzer comes with clang only: apt-get install clang).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
seconds=${1:-60}
shift || true

cc=${CC:-clang}
if ! command -v "${cc%% *}" >/dev/null; then
    echo "run.sh: $cc not found (libFuzzer needs clang: apt-get install -y clang)" >&2
    exit 2
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/hostembed-fuzz-core.XXXXXX")
build=${FUZZ_BUILD:-$work}
new_inputs=${FUZZ_NEW_INPUTS:-$work/new}
artifacts=${FUZZ_ARTIFACTS:-$work/artifacts}
mkdir -p "$build" "$new_inputs" "$artifacts"
binary=$build/fuzz_core

# -ffp-contract=off: the SparseAdam and grad_reduce references round every
# float operation on their own, as the core's build does. HE_NO_CLONES: no
# target_clones (their ifunc resolvers run before the sanitizer runtime).
# -fno-sanitize-recover: any UB aborts, so libFuzzer saves the input. The
# harness is built without comparison tracing: its reference loops would
# otherwise cost more than the core's (the core keeps full coverage
# instrumentation, which is what guides the fuzzer).
flags=(-std=c11 -O1 -g -fno-sanitize-recover=all -fno-omit-frame-pointer -ffp-contract=off -fno-math-errno
       -pthread -DHE_NO_CLONES -Wall -Wextra -Wno-missing-field-initializers -I"$repo/include" -I"$repo/csrc")
rm -rf "$build/obj" && mkdir -p "$build/obj"
$cc "${flags[@]}" -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-coverage=trace-cmp \
    -c "$here/fuzz_core.c" -o "$build/obj/fuzz_core.o"
for src in "$repo"/csrc/[a-z]*.c; do
    $cc "${flags[@]}" -fsanitize=fuzzer-no-link,address,undefined -c "$src" -o "$build/obj/$(basename "$src" .c).o"
done
$cc -fsanitize=fuzzer,address,undefined -pthread "$build"/obj/*.o -lm -o "$binary"

echo "fuzz_core: ${seconds}s; new inputs in $new_inputs, artifacts in $artifacts" >&2
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# The first corpus directory receives new inputs; the seeds are only read.
exec "$binary" -max_total_time="$seconds" -print_final_stats=1 -max_len=4096 -timeout=20 \
    -artifact_prefix="$artifacts/" "$@" "$new_inputs" "$repo/fuzz/corpus/core"
