#!/bin/sh
# refuse_test.sh BENCH MESSAGE ARG...: BENCH ARG... exits 2 with MESSAGE on stderr and nothing on
# stdout, i.e. a bad or conflicting argument is refused by name before any benchmark runs.
bench=$1 message=$2
shift 2
errfile=$(mktemp) || exit 1
out=$("$bench" "$@" 2>"$errfile")
rc=$?
err=$(cat "$errfile")
rm -f "$errfile"
[ $rc -eq 2 ] || { echo "$bench $*: exited $rc, not 2 (stdout: $out; stderr: $err)"; exit 1; }
[ -z "$out" ] || { echo "$bench $*: printed on stdout: $out"; exit 1; }
case $err in
  *"$message"*) ;;
  *) echo "$bench $*: stderr does not say '$message': $err"; exit 1 ;;
esac
echo "ok: $bench $*"
