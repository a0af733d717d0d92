#!/bin/sh
# help_test.sh BENCH: BENCH --help and BENCH -h exit 0 printing "usage:"; BENCH --no-such-flag
# exits 2.
bench=$1
for flag in --help -h; do
  out=$("$bench" $flag) || { echo "$bench $flag exited $?"; exit 1; }
  case $out in
    usage:*) ;;
    *) echo "$bench $flag printed no usage: $out"; exit 1 ;;
  esac
done
"$bench" --no-such-flag >/dev/null 2>&1
rc=$?
[ $rc -eq 2 ] || { echo "$bench --no-such-flag exited $rc, not 2"; exit 1; }
echo "ok: $bench"
