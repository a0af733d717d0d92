#!/bin/sh
# help_test.sh BENCH: BENCH --help exits 0 printing "usage:"; BENCH --no-such-flag exits 2.
bench=$1
out=$("$bench" --help) || { echo "$bench --help exited $?"; exit 1; }
case $out in
  usage:*) ;;
  *) echo "$bench --help printed no usage: $out"; exit 1 ;;
esac
"$bench" --no-such-flag >/dev/null 2>&1
rc=$?
[ $rc -eq 2 ] || { echo "$bench --no-such-flag exited $rc, not 2"; exit 1; }
echo "ok: $bench"
