#!/usr/bin/python3
# tests/paper/check_report.py: runs `bench/paper_table.py --quick` into a fresh --out (unless
# --check-only) and checks that its report is produced and well-formed: every section and table
# row, finite numbers in results.json and report.md, SVG plots that parse. Exits 1 naming the fault.
import argparse
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET

SECTIONS = ["## Variants", "## Test-time scaling", "## Decode cost", "## Rare tokens",
            "## Commands"]
PLOTS = ["variants.svg", "scaling.svg", "decode.svg", "rare_0.svg", "rare_1.svg"]
N_VARIANTS, N_SCALING, SCALING_T = 12, 4, range(1, 9)
# The driver runs from the corpus directory with the quick mode's own files as relative --data:
# a rerun must still recognise its runs (the trainer saves --data absolute).
FORTUNES = "/usr/share/games/fortunes"
QUICK_DATA = ["riddles", "love", "pratchett"]  # pratchett: a cut with no document start near


def finite(x, what, faults):
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        faults.append(f"{what} = {x!r} is not a finite number")


def check_results(res, faults):
    if len(res.get("variants", [])) != N_VARIANTS:
        faults.append(f"results.json: expected {N_VARIANTS} variants")
    for r in res.get("variants", []):
        for key in ("params_total", "params_non_embedding", "tokens_per_s",
                    "tokens_per_cpu_s"):
            finite(r.get(key), f"{r.get('name')}.{key}", faults)
        finite(r.get("ppl", {}).get("1"), f"{r.get('name')}.ppl[T=1]", faults)
    if len(res.get("scaling", [])) != N_SCALING:
        faults.append(f"results.json: expected {N_SCALING} scaling models")
    for r in res.get("scaling", []):
        for t in SCALING_T:
            finite(r.get("ppl", {}).get(str(t)), f"{r.get('name')}.ppl[T={t}]", faults)
    for t in SCALING_T:
        ms = res.get("decode", {}).get(str(t), {}).get("ms_per_token")
        finite(ms, f"decode[T={t}]", faults)
        if isinstance(ms, (int, float)) and not ms > 0:  # a time per token is positive
            faults.append(f"decode[T={t}] = {ms!r} ms per token is not positive")
    if len(res.get("rare", {})) != 4:
        faults.append("results.json: expected rare-token buckets for 4 models")
    for name, buckets in res.get("rare", {}).items():
        kept = [b for b in buckets if b is not None]
        if not kept:
            faults.append(f"rare[{name}]: no bucket has tokens")
        for b in kept:
            finite(b.get("ppl"), f"rare[{name}].ppl", faults)


def check_report(text, faults):
    for s in SECTIONS:
        if s not in text:
            faults.append(f"report.md: section '{s}' missing")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    if len(rows) < 1 + N_VARIANTS + 1 + N_SCALING + 2 + 2 * 2:
        faults.append(f"report.md: only {len(rows)} table rows")
    for line in rows:
        if re.search(r"\b(nan|inf)\b", line, re.IGNORECASE):
            faults.append(f"report.md: non-finite number in '{line}'")


def check(out):
    faults = []
    for name in ["report.md", "results.json"] + PLOTS:
        if not os.path.isfile(os.path.join(out, name)):
            faults.append(f"{name} was not written")
    if faults:
        return faults
    with open(os.path.join(out, "results.json")) as f:
        check_results(json.load(f), faults)
    with open(os.path.join(out, "report.md")) as f:
        check_report(f.read(), faults)
    for name in PLOTS:
        try:
            if not ET.parse(os.path.join(out, name)).getroot().tag.endswith("svg"):
                faults.append(f"{name}: root element is not <svg>")
        except ET.ParseError as e:
            faults.append(f"{name}: not well-formed XML ({e})")
    return faults


def fnv1a64(data):
    """trainer/src/data.cc hash_bytes."""
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def check_split(driver, out, faults):
    """The driver's train/validation ids are the trainer's: same sizes as the trainer logged, and
    validation ids whose hash is the one the trainer saved."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(driver)))
    import paper_table  # noqa: E402 (the driver, imported for its split)
    train_ids, val_ids = paper_table.cache_splits(os.path.join(out, "cache"))
    with open(os.path.join(out, "logs", "llama_tied.log")) as f:
        m = re.search(r"data: \d+ files, (\d+) training and (\d+) validation tokens", f.read())
    if not m:
        faults.append("logs/llama_tied.log: no 'data:' line from the trainer")
    elif (len(train_ids), len(val_ids)) != (int(m.group(1)), int(m.group(2))):
        faults.append(f"the driver's split is {len(train_ids)} + {len(val_ids)} ids, the "
                      f"trainer's {m.group(1)} + {m.group(2)}")
    with open(os.path.join(out, "runs", "llama_tied", "trainer_state.json")) as f:
        saved = json.load(f).get("validation_hash")
    mine = fnv1a64(struct.pack(f"<{len(val_ids)}i", *val_ids))
    if saved != mine:
        faults.append(f"the driver's validation ids hash to {mine}, the trainer's to {saved}")


def check_rerun(cmd, out, faults):
    """A rerun into the same --out reuses finished runs; one with other settings is refused."""
    again = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           cwd=FORTUNES)
    if again.returncode != 0:
        faults.append(f"a rerun with the same settings failed: {again.stderr[-500:]}")
    elif "[paper] training" in again.stdout or "[paper] resuming" in again.stdout:
        faults.append("a rerun with the same settings trained again")
    other = subprocess.run(cmd + ["--steps", "7"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=FORTUNES)
    if other.returncode == 0 or "trained with other settings" not in other.stderr:
        faults.append("a rerun with other --steps reused the old runs: "
                      f"rc {other.returncode}, {other.stderr[-300:]!r}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--driver", help="bench/paper_table.py")
    p.add_argument("--cemlm", help="the cemlm binary")
    p.add_argument("--out", required=True)
    p.add_argument("--check-only", action="store_true", help="check --out without running")
    args = p.parse_args()
    args.out = os.path.abspath(args.out)
    cmd = [sys.executable, os.path.abspath(args.driver), "--quick", "--cemlm",
           os.path.abspath(args.cemlm), "--out", args.out, "--data", *QUICK_DATA]
    if not args.check_only:
        shutil.rmtree(args.out, ignore_errors=True)
        if subprocess.run(cmd, cwd=FORTUNES).returncode != 0:
            sys.exit("check_report: the driver failed: " + " ".join(cmd))
    faults = check(args.out)
    if not args.check_only and not faults:
        check_split(args.driver, args.out, faults)
        check_rerun(cmd, args.out, faults)
    for f in faults:
        print("check_report:", f)
    sys.exit(1 if faults else 0)


if __name__ == "__main__":
    main()
