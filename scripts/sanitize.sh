#!/usr/bin/env bash
# Builds cemlm under a sanitizer and runs the tests it can run. Not part of CI: a sanitizer build
# and run take 30-40 minutes on 2 cores.
#   scripts/sanitize.sh address   AddressSanitizer + UndefinedBehaviorSanitizer (build-asan), the
#                                 whole ctest suite
#   scripts/sanitize.sh thread    ThreadSanitizer (build-tsan), the engine's test programs and
#                                 the compute pool's, with OpenMP limited to one thread (libgomp
#                                 is not instrumented: its barriers are invisible to TSan); the
#                                 pool (kernels/cpu/parallel.cc) keeps its threads (OMP_THREAD_LIMIT
#                                 does not bound it) and is checked. The server is left out: its
#                                 callbacks are ordered by gRPC's own synchronization, which the
#                                 Debian libgrpc hides from TSan (hundreds of false reports).
# Tests that need the SentencePiece plugin cannot run under a sanitizer: the plugin is dlopen'ed
# with RTLD_DEEPBIND (engine/src/spm_api.h says why), which the sanitizer runtimes refuse. Those
# suites' failures are listed apart (PLUGIN_SUITES); any other failure, and any sanitizer report
# from any process (the tests and the programs they start), fails the script.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."  # through a symlink too
kind=${1:-}
case "$kind" in
  address) flags="-fsanitize=address,undefined" extra=" -fno-sanitize-recover=undefined" ;;
  thread) flags="-fsanitize=thread" extra="" ;;
  *) echo "usage: scripts/sanitize.sh address|thread" >&2; exit 2 ;;
esac
build=build-${kind:0:1}san
PLUGIN_SUITES='^(EngineText|GenerateCliText|Server(Auth|Deadlines|Drain|Files|Generate|Lifecycle|Queue|Tls|Tokenizer|Validation)|Tokenizer|DataTest|Train|paper_)'
mkdir -p "$build"
# A step that fails shows the end of its log (set -e alone would exit without a word).
failed_step() {
  echo "sanitize: $1 failed; the end of $2:" >&2
  tail -50 "$2" >&2
  exit 1
}
CEMLM_SETUP_TESTS=1 scripts/setup.sh > "$build/setup.log" 2>&1 ||  # the Debian packages (and the normal build)
  failed_step "scripts/setup.sh" "$build/setup.log"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCEMLM_CUDA=OFF -DCEMLM_BUILD_TESTS=ON \
  -DCMAKE_CXX_FLAGS="$flags -fno-omit-frame-pointer$extra" -DCMAKE_EXE_LINKER_FLAGS="$flags" \
  -DCMAKE_SHARED_LINKER_FLAGS="$flags" > "$build/build.log" 2>&1 ||
  failed_step "configuring $build" "$build/build.log"
log=$build/sanitize.log
ctest_rc=0
reports=$build/reports
rm -rf "$reports" && mkdir -p "$reports"
if [ "$kind" = address ]; then
  cmake --build "$build" -j"$(nproc)" >> "$build/build.log" 2>&1 ||
    failed_step "building $build" "$build/build.log"
  # A test asks for a 4 PiB KV cache on purpose: the allocator must fail it, not abort.
  # (The path quoted for the sanitizers' option parser: a repository path may hold spaces.)
  export ASAN_OPTIONS="allocator_may_return_null=1:detect_leaks=1:log_path='$PWD/$reports/asan'"
  export UBSAN_OPTIONS="print_stacktrace=1:log_path='$PWD/$reports/ubsan'"
  export OMP_WAIT_POLICY=passive
  ctest --test-dir "$build" -j2 --timeout 1800 --output-on-failure > "$log" 2>&1 || ctest_rc=$?
else
  cmake --build "$build" -j"$(nproc)" --target engine_test engine_real_test parallel_test \
    >> "$build/build.log" 2>&1 || failed_step "building $build" "$build/build.log"
  export OMP_THREAD_LIMIT=1
  export TSAN_OPTIONS="allocator_may_return_null=1:log_path='$PWD/$reports/tsan'"
  # NoThreadOutlivesTheEngine counts threads, and TSan adds one of its own; TSan refuses threads
  # started in a forked child (the pool's tests that run in one: fork, rests).
  ctest --test-dir "$build" -j2 --timeout 1800 --output-on-failure \
    -R '^(Engine|Variants/EngineReal|ComputePool)' \
    -E 'NoThreadOutlives|EngineText|Cli|Fork|NeverComes|Rest' \
    > "$log" 2>&1 || ctest_rc=$?
fi
python3 - "$log" "$reports" "$PLUGIN_SUITES" "$ctest_rc" <<'EOF'
import pathlib, re, sys
log, reports, plugin_suites, ctest_rc = sys.argv[1:5]
text = open(log).read()
# ctest's list after "The following tests FAILED:", one line each, whatever the way it failed:
# "  12 - Suite.Name (Failed)", "(Timeout)", "(Subprocess aborted)", "(SEGFAULT)", "(Not Run)",
# and parameterised names with "  # GetParam() = …" before the parenthesis.
failed = []
if "The following tests FAILED:" in text:
    for line in text.split("The following tests FAILED:", 1)[1].splitlines()[1:]:
        m = re.match(r"^\s*\d+ - (\S+).*\([^()]+\)\s*$", line)
        if not m:
            break
        failed.append(m.group(1))
if ctest_rc != "0" and not failed:
    print(f"sanitize: ctest exited {ctest_rc} without a list of failed tests; see {log}")
    sys.exit(1)
blocked = [n for n in failed if re.match(plugin_suites, n)]
real = [n for n in failed if n not in blocked]
total = re.search(r"tests failed out of (\d+)", text)
print(f"sanitize: {total.group(1) if total else '?'} tests; {len(blocked)} failed in suites that "
      f"need the SentencePiece plugin; {len(real)} other failures")
for name in real:
    print("  FAILED", name)
found = set()
for f in sorted(pathlib.Path(reports).iterdir()):
    for line in f.read_text(errors="replace").splitlines():
        # (The KV-budget test's 4 PiB request is refused with a "failed to allocate" warning.)
        if re.search(r"(ERROR|WARNING): \w+Sanitizer|runtime error:", line) and \
                "failed to allocate" not in line:
            found.add(re.sub(r"==\d+==|\(pid=\d+\)|0x[0-9a-f]+", "", line).strip())
for r in sorted(found):
    print("  REPORT", r)
if found:
    print(f"  (full reports in {reports})")
sys.exit(1 if real or found else 0)
EOF
