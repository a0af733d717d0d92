#!/usr/bin/python3
# bench/paper_table.py: the papers' comparisons at small scale, driven through the `cemlm` binary
# (train, inspect, score, generate): the variant table, test-time recursion scaling with decode
# cost, and perplexity by train-frequency bucket for LEV against table embeddings. Writes
# report.md, results.json and SVG plots into --out. Python 3 standard library only.
import argparse
import collections
import json
import math
import os
import platform
import re
import resource
import shlex
import struct
import subprocess
import sys
import time

FORTUNES = "/usr/share/games/fortunes"

# Model shape and run budget per mode; every run of one invocation shares them.
MODES = {
    "full": dict(vocab=2048, d_model=64, n_layers=2, n_heads=2, head_dim=32, d_ff=192,
                 seq_len=64, batch=8, steps=500, warmup=50, eval_windows=32, rare_windows=24,
                 decode_tokens=240, decode_repeats=5,
                 data=[FORTUNES]),
    "quick": dict(vocab=512, d_model=16, n_layers=1, n_heads=1, head_dim=16, d_ff=32,
                  seq_len=32, batch=2, steps=6, warmup=2, eval_windows=4, rare_windows=4,
                  decode_tokens=8, decode_repeats=1,
                  data=[os.path.join(FORTUNES, "riddles"), os.path.join(FORTUNES, "love")]),
}

TABLE_T = [1, 2, 4]
SCALING_T = list(range(1, 9))
RARE_BUCKETS = [(0, 10), (10, 100), (100, 1000), (1000, 10000), (10000, None)]


def variant(name, label, attn="standard", diag="none", attn_rank=0, mlp="swiglu", mlp_rank=0,
            emb="table", tie=True, train_t="2", step="inverse_T", eval_t=TABLE_T):
    return dict(name=name, label=label, attn=attn, diag=diag, attn_rank=attn_rank, mlp=mlp,
                mlp_rank=mlp_rank, emb=emb, tie=tie, train_t=train_t, step=step, eval_t=eval_t)


FULL_CEM = dict(attn="cem", diag="shared", attn_rank=8, mlp="cem", mlp_rank=8)

# The rows of issue 6, in its order. The first full-CEM row doubles as the fixed-T=2 / 1/T
# model of the scaling section, so it is evaluated at every T up to 8.
TABLE_VARIANTS = [
    variant("llama_tied", "Llama baseline (table, tied head)", train_t="1"),
    variant("llama_untied", "Llama, untied head", tie=False, train_t="1"),
    variant("cem_attn_none_T2", "CEM attention, diag none, T=2", attn="cem"),
    variant("cem_attn_shared_T2", "CEM attention, diag shared, T=2", attn="cem", diag="shared"),
    variant("cem_attn_per_head_T2", "CEM attention, diag per_head, T=2", attn="cem",
            diag="per_head"),
    variant("cem_attn_shared_T1", "CEM attention, diag shared, T=1", attn="cem", diag="shared",
            train_t="1"),
    variant("cem_attn_shared_pc_T2", "CEM attention, shared + preconditioner (r8), T=2",
            attn="cem", diag="shared", attn_rank=8),
    variant("cem_mlp_T1", "CEM MLP, T=1", mlp="cem", train_t="1"),
    variant("cem_mlp_T2", "CEM MLP, T=2", mlp="cem"),
    variant("full_cem_T2", "Full CEM (attn+MLP, shared, r8), T=2", eval_t=SCALING_T, **FULL_CEM),
    variant("lev_llama", "LEV + untied head, Llama baseline", emb="lev", tie=False, train_t="1"),
    variant("lev_full_cem_T2", "LEV + untied head, full CEM, T=2", emb="lev", tie=False,
            **FULL_CEM),
]
SCALING_VARIANTS = [
    TABLE_VARIANTS[9],
    variant("full_cem_T2_unit", "Full CEM, fixed T=2, step 1", step="unit", eval_t=SCALING_T,
            **FULL_CEM),
    variant("full_cem_T1-4", "Full CEM, T drawn 1-4, step 1/T", train_t="1-4", eval_t=SCALING_T,
            **FULL_CEM),
    variant("full_cem_T1-4_unit", "Full CEM, T drawn 1-4, step 1", train_t="1-4", step="unit",
            eval_t=SCALING_T, **FULL_CEM),
]
RARE_PAIRS = [("llama_untied", "lev_llama"), ("full_cem_T2", "lev_full_cem_T2")]
DECODE_MODEL = "full_cem_T2"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__ or "paper comparisons through cemlm")
    p.add_argument("--cemlm", default="build/cli/cemlm",
                   help="the cemlm binary (default: build/cli/cemlm)")
    p.add_argument("--out", required=True, help="work and report directory")
    p.add_argument("--quick", action="store_true", help="tiny model and budget (the ctest)")
    p.add_argument("--data", nargs="+", help="corpus files/directories (default: per mode)")
    p.add_argument("--cache", help="shared tokenizer/token cache (default: OUT/cache)")
    p.add_argument("--steps", type=int, help="training steps per run (default: per mode)")
    p.add_argument("--threads", type=int, default=2,
                   help="cemlm's --threads for every run (default: 2)")
    p.add_argument("--seed", type=int, default=1,
                   help="cemlm train's --seed for every run (default: 1)")
    p.add_argument("--max-minutes", type=float, default=0,
                   help="wall-clock cap per training run in minutes (0: none, the default); capped "
                   "runs are marked")
    return p.parse_args()


def run(cmd, log=None):
    """Runs cmd; returns stdout. Fails the script with the command and its stderr."""
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if log:
        with open(log, "a") as f:
            f.write("$ " + shlex.join(cmd) + "\n" + out.stdout + out.stderr)
    if out.returncode != 0:
        sys.exit(f"paper_table: command failed ({out.returncode}): {shlex.join(cmd)}\n"
                 f"{out.stderr[-2000:]}")
    return out.stdout


def model_config(v, m):
    attention = {"type": v["attn"]}
    if v["attn"] == "cem":
        attention.update(diag=v["diag"], precond_rank=v["attn_rank"])
    mlp = {"type": v["mlp"]}
    if v["mlp"] == "cem":
        mlp["precond_rank"] = v["mlp_rank"]
    embedding = {"type": v["emb"], "tie_output": v["tie"]}
    if v["emb"] == "lev":
        embedding["lev"] = {"digits": 3, "seed_dim": 16, "knots": 8, "rank": 16, "heads": 4}
    return {"architecture": "cemlm", "format_version": 1, "vocab_size": m["vocab"],
            "d_model": m["d_model"], "n_layers": m["n_layers"], "n_heads": m["n_heads"],
            "head_dim": m["head_dim"], "d_ff": m["d_ff"], "max_seq_len": 4 * m["seq_len"],
            "embedding": embedding, "attention": attention, "mlp": mlp,
            "recursion": {"default": 2, "max": 8, "step_size": v["step"]}}


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def subset_differences(wanted, saved, prefix=""):
    """The keys of `wanted` (recursively) whose value in `saved` differs, as "key: saved != wanted"."""
    diffs = []
    for key, value in wanted.items():
        got = saved.get(key) if isinstance(saved, dict) else None
        if isinstance(value, dict) and isinstance(got, dict):
            diffs += subset_differences(value, got, prefix + key + ".")
        elif got != value:
            diffs.append(f"{prefix}{key}: {got!r} != {value!r}")
    return diffs


def train(v, args, m, ctx):
    """Trains variant v and returns its metrics. A run already in --out is reused when it was
    made with the same model and options: skipped when it finished, resumed when --max-minutes
    stopped it; one made with other options stops the script (it would be mislabelled)."""
    run_dir = os.path.join(ctx["out"], "runs", v["name"])
    log = os.path.join(ctx["out"], "logs", v["name"] + ".log")
    jsonl = os.path.join(run_dir, "train.jsonl")
    cpu_file = os.path.join(ctx["out"], "logs", v["name"] + ".cpu_s")
    config = model_config(v, m)
    steps = str(m["steps"])
    options = {"steps": m["steps"], "batch_size": m["batch"], "seq_len": m["seq_len"],
               "warmup": m["warmup"], "train_recursion": v["train_t"],
               "eval_recursion": list(v["eval_t"]), "eval_windows": m["eval_windows"],
               "seed": args.seed, "data": list(m["data"])}
    state_file = os.path.join(run_dir, "trainer_state.json")
    cpu_before = 0.0
    if os.path.exists(state_file):
        try:
            with open(state_file) as f:
                saved_options = json.load(f)["options"]
            with open(os.path.join(run_dir, "config.json")) as f:
                saved_config = json.load(f)
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"paper_table: {run_dir} is not a whole checkpoint ({e}); delete it or choose "
                     "another --out")
        diffs = subset_differences(options, saved_options) + subset_differences(config, saved_config)
        if diffs:
            sys.exit(f"paper_table: {run_dir} was trained with other settings ({'; '.join(diffs)});"
                     " delete it or choose another --out")
        cpu_before = float(open(cpu_file).read()) if os.path.exists(cpu_file) else 0.0
        cmd = [ctx["cemlm"], "train", "--out", run_dir, "--resume",
               "--max-minutes", str(args.max_minutes), "--threads", str(args.threads)]
    else:
        cfg = os.path.join(ctx["out"], "configs", v["name"] + ".json")
        with open(cfg, "w") as f:
            json.dump(config, f, indent=1)
        cmd = [ctx["cemlm"], "train", "--config", cfg, "--out", run_dir, "--cache", ctx["cache"],
               "--data", *m["data"], "--steps", steps, "--batch-size", str(m["batch"]),
               "--seq-len", str(m["seq_len"]), "--warmup", str(m["warmup"]),
               "--train-recursion", v["train_t"],
               "--eval-recursion", ",".join(map(str, v["eval_t"])), "--eval-every", steps,
               "--eval-windows", str(m["eval_windows"]), "--save-every", steps,
               "--threads", str(args.threads), "--seed", str(args.seed),
               "--max-minutes", str(args.max_minutes), "--log-every", "20"]
    rows = read_jsonl(jsonl) if os.path.exists(jsonl) else []
    finished = any(r.get("step") == m["steps"] and "val_ppl" in r for r in rows)
    if not finished:
        ctx["commands"].append(cmd)
        print(f"[paper] {'resuming' if '--resume' in cmd else 'training'} {v['name']}", flush=True)
        before = cpu_seconds()
        run(cmd, log)
        with open(cpu_file, "w") as f:
            f.write(f"{cpu_before + cpu_seconds() - before}\n")
        rows = read_jsonl(jsonl)
    steps_rows = [r for r in rows if "loss" in r]
    last_eval = [r for r in rows if "val_ppl" in r][-1]
    last = steps_rows[-1]
    ppl = {int(t): p for t, p in last_eval["val_ppl"].items()}
    params = inspect_params(ctx["cemlm"], run_dir)
    return dict(name=v["name"], label=v["label"], train_t=v["train_t"], step=v["step"],
                steps=last["step"], tokens=last["tokens"], capped=last["step"] < m["steps"],
                tokens_per_s=last["tokens"] / last["elapsed_s"], final_loss=last["loss"],
                tokens_per_cpu_s=last["tokens"] / float(open(cpu_file).read()),
                ppl=ppl, **params)


def inspect_params(cemlm, run_dir):
    """Total, embedding and output-head parameter counts from `cemlm inspect`."""
    counts = {}
    for line in run([cemlm, "inspect", run_dir]).splitlines():
        fields = re.split(r"\s{2,}", line.strip())
        if len(fields) >= 2 and fields[1].replace(",", "").isdigit():
            counts[fields[0].split(" (")[0]] = int(fields[1].replace(",", ""))
    total, emb, head = counts["parameters, total"], counts["embedding"], counts["output head"]
    return dict(params_total=total, params_embedding=emb + head,
                params_non_embedding=total - emb - head)


def validation_part(ids, val_fraction, bos, eos):
    """A file's validation ids, ids[begin:end], and whether its cut fell inside a document
    (trainer/src/data.cc validation_part): its last val_fraction of tokens, moved to the nearest
    document start within half to twice that size; with none there, the file's end through its
    EOS trains and the ids just before it validate."""
    n = len(ids)
    cut = n - math.ceil(n * val_fraction)
    if cut in (0, n) or (bos < 0 and eos < 0):
        return cut, n, False

    def starts_document(p):
        if bos >= 0:
            return ids[p] == bos and (eos < 0 or ids[p - 1] == eos)
        return ids[p - 1] == eos

    n_val = n - cut
    lo, hi = (n - 2 * n_val if n > 2 * n_val else 1), n - (n_val + 1) // 2
    d = 0
    while cut >= lo + d or cut + d <= hi:
        if cut >= lo + d and starts_document(cut - d):
            return cut - d, n, False
        if cut + d <= hi and starts_document(cut + d):
            return cut + d, n, False
        d += 1
    keep = min(n_val, cut // 2)
    if eos < 0 or ids[n - 1] != eos or keep == 0:
        return cut, n, True
    return cut - keep, n - keep, True


def validation_parts(files, val_fraction, bos, eos):
    """Each file's (begin, end) as data.cc validation_parts gives them: validation_part's, but
    with at least 1 / val_fraction files cut inside a document, those go whole to validation
    (while its share of their ids is below val_fraction) or to training, in order."""
    parts = [validation_part(ids, val_fraction, bos, eos) for ids in files]
    if val_fraction <= 0 or sum(p[2] for p in parts) < math.ceil(1 / val_fraction):
        return [(b, e) for b, e, _ in parts]
    out, total, val = [], 0.0, 0.0
    for ids, (b, e, inside) in zip(files, parts):
        if inside:
            total += len(ids)
            to_val = val < val_fraction * total
            b, e = (0 if to_val else len(ids)), len(ids)
            val += len(ids) if to_val else 0
        out.append((b, e))
    return out


def cache_splits(cache_dir, val_fraction=0.05, bos=1, eos=2):
    """Train and validation ids from the trainer's token cache (trainer/src/data.cc layout), split
    as the trainer splits them; bos/eos are the tokenizer's (the paper configs set none)."""
    with open(os.path.join(cache_dir, "tokens.bin"), "rb") as f:
        blob = f.read()
    header = "<8sIIQQQ"  # magic, version, n_files, corpus key, encoding, content hash
    magic, version, n_files, _key, _tok, _hash = struct.unpack_from(header, blob, 0)
    if magic != b"CEMLMTOK" or version != 3:  # the trainer's kCacheVersion
        sys.exit(f"paper_table: {cache_dir}/tokens.bin is not a version 3 cemlm token cache")
    counts = struct.unpack_from(f"<{n_files}Q", blob, struct.calcsize(header))
    pos = struct.calcsize(header) + 8 * n_files
    files = []
    for n in counts:
        files.append(struct.unpack_from(f"<{n}i", blob, pos))
        pos += 4 * n
    train_ids, val_ids = [], []
    for ids, (begin, end) in zip(files, validation_parts(files, val_fraction, bos, eos)):
        train_ids += ids[:begin] + ids[end:]
        val_ids += ids[begin:end]
    return train_ids, val_ids


def eval_windows(tokens, length, max_windows):
    """The trainer's fixed validation windows (data.cc eval_windows)."""
    count = min(max_windows, len(tokens) // length)
    stride = len(tokens) // count
    return [tokens[k * stride:k * stride + length] for k in range(count)]


def bucket_of(count):
    for i, (lo, hi) in enumerate(RARE_BUCKETS):
        if count >= lo and (hi is None or count < hi):
            return i
    raise ValueError(count)


def rare_tokens(ctx, m, train_ids, val_ids):
    """Per-bucket perplexity of each RARE_PAIRS model on the validation windows."""
    freq = collections.Counter(train_ids)
    windows = eval_windows(val_ids, m["seq_len"], m["rare_windows"])
    results = {}
    for name in sorted({n for pair in RARE_PAIRS for n in pair}):
        nll = [0.0] * len(RARE_BUCKETS)
        n = [0] * len(RARE_BUCKETS)
        model = os.path.join(ctx["out"], "runs", name)
        for w in windows:
            out = json.loads(run([ctx["cemlm"], "score", "--model", model,
                                  "--ids", ",".join(map(str, w))]))
            for tok, lp in zip(w[1:], out["logprobs"][1:]):
                b = bucket_of(freq[tok])
                nll[b] -= lp
                n[b] += 1
        results[name] = [dict(tokens=n[b], ppl=math.exp(nll[b] / n[b])) if n[b] else None
                         for b in range(len(RARE_BUCKETS))]
    return results


def decode_cost(ctx, m, val_ids):
    """Milliseconds per generated token at each T, from the engine's own timing of one
    `cemlm generate --json` of `decode_tokens` tokens: e2e_seconds - first_token_seconds over
    the tokens after the first, so process start, model load and the prefill stay out of it;
    the best of `decode_repeats` runs. (Timing whole processes of N tokens against 1 let their
    start-up's variance swamp a tiny model's decode: it gave negative costs.)"""
    model = os.path.join(ctx["out"], "runs", DECODE_MODEL)
    prompt = ",".join(map(str, val_ids[:8]))
    costs = {}
    for t in SCALING_T:
        cmd = [ctx["cemlm"], "generate", "--model", model, "--prompt-ids", prompt,
               "--recursion", str(t), "--max-new-tokens", str(m["decode_tokens"]),
               "--temperature", "0", "--threads", str(ctx["threads"]), "--json"]
        best = None
        for _ in range(m["decode_repeats"]):
            out = json.loads(run(cmd))
            timing, n = out["timing"], len(out["ids"])
            ms = 1000 * (timing["e2e_seconds"] - timing["first_token_seconds"]) / max(n - 1, 1)
            best = ms if best is None else min(best, ms)
        costs[t] = dict(ms_per_token=best, tokens=n)
    return costs


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine():
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores, {cpu}, {platform.system()} {platform.release()}"


# ---- SVG plots -------------------------------------------------------------------------------

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def svg_frame(title, xlabel, ylabel, w=640, h=400):
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
            f'font-family="sans-serif" font-size="12">',
            f'<rect width="{w}" height="{h}" fill="white"/>',
            f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{esc(title)}</text>',
            f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle">{esc(xlabel)}</text>',
            f'<text x="14" y="{h / 2}" text-anchor="middle" transform="rotate(-90 14 {h / 2})">'
            f'{esc(ylabel)}</text>']


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def y_axis(lo, hi, top, bottom, left, right):
    """Five gridlines with labels; returns the value→pixel map."""
    span = (hi - lo) or 1.0

    def y(v):
        return bottom - (v - lo) / span * (bottom - top)
    parts = []
    for k in range(5):
        v = lo + span * k / 4
        parts.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{right}" y2="{y(v):.1f}" '
                     f'stroke="#ddd"/><text x="{left - 4}" y="{y(v) + 4:.1f}" '
                     f'text-anchor="end">{v:.4g}</text>')
    return y, parts


def line_chart(path, title, xlabel, ylabel, xs, series):
    """series: [(name, [y or None per x])]; x is categorical (evenly spaced)."""
    w, h, left, right, top, bottom = 640, 400, 70, 450, 40, 350
    vals = [v for _, ys in series for v in ys if v is not None]
    lo, hi = min(vals), max(vals)
    pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
    y, grid = y_axis(lo - pad, hi + pad, top, bottom, left, right)

    def x(i):
        return left + (i + 0.5) * (right - left) / len(xs)
    parts = svg_frame(title, xlabel, ylabel, w, h) + grid
    parts += [f'<text x="{x(i):.1f}" y="{bottom + 16}" text-anchor="middle">{esc(v)}</text>'
              for i, v in enumerate(xs)]
    for k, (name, ys) in enumerate(series):
        c = COLORS[k % len(COLORS)]
        pts = [(x(i), y(v)) for i, v in enumerate(ys) if v is not None]
        parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="' +
                     " ".join(f"{a:.1f},{b:.1f}" for a, b in pts) + '"/>')
        parts += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{c}"/>' for a, b in pts]
        parts.append(f'<rect x="{right + 12}" y="{top + 18 * k}" width="12" height="12" '
                     f'fill="{c}"/><text x="{right + 28}" y="{top + 18 * k + 10}">'
                     f'{esc(name)}</text>')
    write_svg(path, parts)


def bar_chart(path, title, xlabel, labels, values):
    """Horizontal bars, one per label."""
    row, left, right, top = 22, 340, 640, 40
    h = top + row * len(labels) + 40
    hi = max(values) * 1.1 or 1.0
    parts = svg_frame(title, xlabel, "", 700, h)
    for i, (lab, v) in enumerate(zip(labels, values)):
        yy = top + row * i
        bw = v / hi * (right - left)
        parts.append(f'<text x="{left - 6}" y="{yy + 14}" text-anchor="end">{esc(lab)}</text>'
                     f'<rect x="{left}" y="{yy + 3}" width="{bw:.1f}" height="{row - 6}" '
                     f'fill="{COLORS[0]}"/><text x="{left + bw + 4:.1f}" y="{yy + 14}">'
                     f'{v:.1f}</text>')
    write_svg(path, parts)


def write_svg(path, parts):
    with open(path, "w") as f:
        f.write("\n".join(parts + ["</svg>"]) + "\n")


# ---- report ----------------------------------------------------------------------------------

def fmt_params(n):
    return f"{n / 1e3:.1f}K" if n < 1e6 else f"{n / 1e6:.2f}M"


def variant_table(rows):
    out = ["| variant | train T | params total | params w/o emb+head | val ppl T=1 | T=2 | T=4 "
           "| train tok/s | tok/CPU-s | steps |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ppl = r["ppl"]
        cells = [f"{ppl[t]:.2f}" if t in ppl else f"{ppl[1]:.2f}†" for t in TABLE_T]
        out.append(f"| {r['label']} | {r['train_t']} | {fmt_params(r['params_total'])} | "
                   f"{fmt_params(r['params_non_embedding'])} | {' | '.join(cells)} | "
                   f"{r['tokens_per_s']:.0f} | {r['tokens_per_cpu_s']:.0f} | "
                   f"{r['steps']}{'*' if r['capped'] else ''} |")
    out.append("\n† no CEM sub-layer: T changes nothing, the T=1 value is repeated. "
               "* stopped early by --max-minutes.")
    return "\n".join(out)


def scaling_table(rows):
    out = ["| model | " + " | ".join(f"T={t}" for t in SCALING_T) + " | best T |",
           "|---|" + "---|" * (len(SCALING_T) + 1)]
    for r in rows:
        best = min(SCALING_T, key=lambda t: r["ppl"][t])
        out.append(f"| {r['label']} | " + " | ".join(f"{r['ppl'][t]:.2f}" for t in SCALING_T) +
                   f" | {best} |")
    return "\n".join(out)


def decode_table(costs):
    return "\n".join(["| T | " + " | ".join(str(t) for t in SCALING_T) + " |",
                      "|---|" + "---|" * len(SCALING_T),
                      "| ms / token | " + " | ".join(f"{costs[t]['ms_per_token']:.3f}"
                                                     for t in SCALING_T) + " |"])


def bucket_name(b):
    lo, hi = RARE_BUCKETS[b]
    return f"≥{lo}" if hi is None else f"{lo}–{hi - 1}"


def rare_table(rare, names):
    out = ["| train count of target | " + " | ".join(f"{n} ppl" for n in names) +
           " | val tokens |", "|---|" + "---|" * (len(names) + 1)]
    for b in range(len(RARE_BUCKETS)):
        if rare[names[0]][b] is None:
            continue
        out.append(f"| {bucket_name(b)} | " +
                   " | ".join(f"{rare[n][b]['ppl']:.2f}" for n in names) +
                   f" | {rare[names[0]][b]['tokens']} |")
    return "\n".join(out)


def scaling_verdict(rows):
    falls = [r["label"] for r in rows if r["ppl"][max(SCALING_T)] < r["ppl"][1]]
    if falls:
        return ("Perplexity is lower at T=8 than at T=1 for: " + "; ".join(falls) + ".")
    return ("No setting tried makes perplexity fall from T=1 to T=8: all four models above "
            "(fixed T=2 and T drawn from 1-4, each with step 1/T and step 1) were tried.")


def write_report(out, res):
    m = res["mode"]
    lines = [f"# cemlm paper comparisons ({res['mode_name']} mode)", "",
             f"Machine: {res['machine']}. Wall time: {res['wall_s'] / 60:.1f} min.", "",
             f"Model: D={m['d_model']}, L={m['n_layers']}, H={m['n_heads']}×{m['head_dim']}, "
             f"d_ff={m['d_ff']}, V={m['vocab']}; {m['steps']} steps × {m['batch']} rows × "
             f"{m['seq_len']} tokens, seed {res['seed']}, {res['threads']} threads; validation "
             f"on {m['eval_windows']} windows of {m['seq_len']} tokens; data: "
             f"{' '.join(m['data'])}.", "",
             "## Variants", "", variant_table(res["variants"]), "",
             "![validation perplexity at T=2](variants.svg)", "",
             "## Test-time scaling", "", scaling_table(res["scaling"]), "",
             scaling_verdict(res["scaling"]), "", "![perplexity against T](scaling.svg)", "",
             "## Decode cost", "",
             f"`cemlm generate --json` on {DECODE_MODEL}, greedy, {m['decode_tokens']} new tokens, "
             f"{res['threads']} threads: the engine's decode time (its timing's e2e minus first "
             f"token) per token after the first, best of {m['decode_repeats']}; prompt: the "
             "first 8 validation ids.", "",
             decode_table(res["decode"]), "", "![decode cost against T](decode.svg)", "",
             "## Rare tokens", "",
             f"Validation perplexity by the training-set count of the target token, "
             f"{m['rare_windows']} windows of {m['seq_len']} tokens, `cemlm score` at the "
             "model's default T (2).", ""]
    for k, pair in enumerate(RARE_PAIRS):
        lines += [rare_table(res["rare"], list(pair)), "", f"![rare tokens](rare_{k}.svg)", ""]
    lines += ["## Commands", "", "```", shlex.join(res["argv"])] + \
             [shlex.join(c) for c in res["commands"][:1]] + ["```", "",
              "The other runs differ only in --config, --out, --train-recursion and "
              "--eval-recursion (every command is in results.json, the configs in configs/).", ""]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines))


def write_plots(out, res):
    bar_chart(os.path.join(out, "variants.svg"), "validation perplexity at T=2 (lower is better)",
              "perplexity", [r["label"] for r in res["variants"]],
              [r["ppl"].get(2, r["ppl"][1]) for r in res["variants"]])
    line_chart(os.path.join(out, "scaling.svg"), "validation perplexity against inference T",
               "T", "perplexity", SCALING_T,
               [(r["name"], [r["ppl"][t] for t in SCALING_T]) for r in res["scaling"]])
    line_chart(os.path.join(out, "decode.svg"), f"decode cost per token ({DECODE_MODEL})", "T",
               "ms / token", SCALING_T,
               [("decode", [res["decode"][t]["ms_per_token"] for t in SCALING_T])])
    for k, pair in enumerate(RARE_PAIRS):
        kept = [b for b in range(len(RARE_BUCKETS)) if res["rare"][pair[0]][b] is not None]
        line_chart(os.path.join(out, f"rare_{k}.svg"), "perplexity by train-set frequency",
                   "train count of the target token", "perplexity",
                   [bucket_name(b) for b in kept],
                   [(n, [res["rare"][n][b]["ppl"] for b in kept]) for n in pair])


def main():
    args = parse_args()
    start = time.time()
    mode_name = "quick" if args.quick else "full"
    m = dict(MODES[mode_name])
    if args.data:  # absolute, as the trainer saves them: a rerun from elsewhere matches its runs
        m["data"] = [os.path.abspath(d) for d in args.data]
    if args.steps:
        m["steps"], m["warmup"] = args.steps, max(1, args.steps // 10)
    out = os.path.abspath(args.out)
    for sub in ("runs", "logs", "configs"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    ctx = dict(out=out, cemlm=os.path.abspath(args.cemlm), commands=[], threads=args.threads,
               cache=os.path.abspath(args.cache or os.path.join(out, "cache")))
    results = {}
    for v in TABLE_VARIANTS + SCALING_VARIANTS[1:]:
        results[v["name"]] = train(v, args, m, ctx)
    train_ids, val_ids = cache_splits(ctx["cache"])
    print("[paper] decode cost and rare-token scoring", flush=True)
    res = dict(mode_name=mode_name, mode=m, seed=args.seed, threads=args.threads,
               machine=machine(), argv=[sys.executable] + sys.argv, commands=ctx["commands"],
               variants=[results[v["name"]] for v in TABLE_VARIANTS],
               scaling=[results[v["name"]] for v in SCALING_VARIANTS],
               decode=decode_cost(ctx, m, val_ids),
               rare=rare_tokens(ctx, m, train_ids, val_ids))
    res["wall_s"] = time.time() - start
    write_plots(out, res)
    write_report(out, res)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"[paper] report: {os.path.join(out, 'report.md')}", flush=True)


if __name__ == "__main__":
    main()
