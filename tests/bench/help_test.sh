#!/bin/sh
# help_test.sh BENCH [FLAG]: BENCH --help and BENCH -h exit 0 printing "usage:"; BENCH
# --no-such-flag exits 2; with FLAG (one that takes a value), BENCH FLAG alone exits 2 saying that
# a value is needed after it.
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
if [ -n "${2:-}" ]; then
  err=$("$bench" "$2" 2>&1 >/dev/null)
  rc=$?
  [ $rc -eq 2 ] || { echo "$bench $2 exited $rc, not 2"; exit 1; }
  case $err in
    *"a value is needed after $2"*) ;;
    *) echo "$bench $2 did not say that a value is needed: $err"; exit 1 ;;
  esac
fi
echo "ok: $bench"
