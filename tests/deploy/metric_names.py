#!/usr/bin/python3
"""Metric names used by deploy/: the Grafana dashboards, the Prometheus alert rules and the
prometheus-adapter rule. Prints them (one a line), checks them, their labels and the functions
applied to them against expected_metrics.txt (--check-allowed), or against a scrape of a live
server (--check-exposition FILE, '-' for stdin).
Also imported by deploy_checks.py, which needs the same PromQL extraction."""
import argparse
import json
import pathlib
import re
import sys

import yaml

HERE = pathlib.Path(__file__).resolve().parent
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Series Prometheus makes itself; the alert rules use `up` to see a server that is down.
SYNTHETIC = {"up"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_OFFSET = re.compile(r"\boffset\s+-?\w+")
_VARIABLE = re.compile(r"\$\{?\w+(?::\w+)?\}?")
# Grafana's templating function: label_values(metric_selector, label) or label_values(label).
_LABEL_VALUES = re.compile(r"label_values\(\s*(?:(.*?)\s*,\s*)?(\w+)\s*\)")
_TOKEN = re.compile(r"\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"}
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)?\s*(\{[^{}]*\})")
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
# A function applied directly to a selector with a range: rate(foo{...}[5m]).
_RANGE_CALL = re.compile(r"\b(\w+)\s*\(\s*([A-Za-z_:][\w:]*)\s*(?:\{[^{}]*\})?\s*\[")
COUNTER_FUNCTIONS = {"rate", "irate", "increase", "resets"}
GAUGE_FUNCTIONS = {"delta", "idelta", "deriv", "predict_linear", "holt_winters",
                   "double_exponential_smoothing"}
# Aggregations that merge series (topk, bottomk and limitk keep theirs), grouped before or after.
_AGGREGATION = re.compile(r"\b(?:sum|avg|min|max|count|group|stddev|stdvar|quantile|count_values)"
                          r"\s*(?:(by|without)\s*\(([^()]*)\)\s*)?\(")
_TRAILING_GROUPING = re.compile(r"\s*(by|without)\s*\(([^()]*)\)")


def promql_metric_names(expr):
    """Metric names an expression selects: identifiers that are not functions, keywords, labels
    (in matchers or groupings), durations or Grafana variables."""
    expr = _STRING.sub('""', expr)
    expr = _LABEL_VALUES.sub(lambda m: m.group(1) or "", expr)
    for pattern in (_MATCHERS, _RANGE, _GROUPING, _OFFSET, _VARIABLE):
        expr = pattern.sub(" ", expr)
    names = set()
    for m in _TOKEN.finditer(expr):
        name, call = m.group(1), m.group(2)
        if name and not call and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def dashboard_exprs(path):
    """(where, expression) for every query of a Grafana dashboard: panel targets and variables."""
    dash = json.loads(path.read_text())
    out = []

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))  # collapsed rows hold their panels

    for p in panels(dash.get("panels", [])):
        for t in p.get("targets", []):
            if "expr" in t:
                out.append((f"{path.name} panel '{p.get('title')}' {t.get('refId')}", t["expr"]))
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            q = q.get("query", "") if isinstance(q, dict) else (q or "")
            out.append((f"{path.name} variable '{v.get('name')}'", q))
    return out


def rule_exprs(path):
    out = []
    for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
        for rule in group.get("rules", []):
            name = rule.get("alert") or rule.get("record")
            out.append((f"{path.name} rule '{name}'", rule["expr"]))
    return out


def adapter_exprs(path):
    rules = (yaml.safe_load(path.read_text()) or {}).get("rules", {})
    return [(f"{path.name} adapter rule '{r.get('name', {}).get('as')}'", r["seriesQuery"])
            for r in rules.get("custom", [])]


def all_exprs(deploy_dir):
    out = []
    for p in sorted((deploy_dir / "grafana" / "dashboards").glob("*.json")):
        out += dashboard_exprs(p)
    for p in sorted((deploy_dir / "prometheus" / "rules").glob("*.yml")):
        out += rule_exprs(p)
    out += adapter_exprs(deploy_dir / "k8s" / "prometheus-adapter-values.yaml")
    return out


def expected(path=HERE / "expected_metrics.txt"):
    """[(family name, type, label names)] from expected_metrics.txt, model_name among the labels
    (le is not: it is on the _bucket series only)."""
    out = []
    for line in path.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            name, kind, *labels = fields
            out.append((name, kind, {"model_name", *filter(None, ",".join(labels).split(","))}))
    return out


def expected_families(path=HERE / "expected_metrics.txt"):
    """{family name: type} from expected_metrics.txt."""
    return {name: kind for name, kind, _ in expected(path)}


def expected_labels(path=HERE / "expected_metrics.txt"):
    """{family name: label names} from expected_metrics.txt."""
    return {name: labels for name, _, labels in expected(path)}


def added_labels(deploy_dir):
    """Labels Prometheus gives every series it scrapes: job, instance, the target_labels of the
    relabelling in deploy/prometheus/*.yml, and those prometheus-adapter maps to resources."""
    added = {"job", "instance"}
    for p in (deploy_dir / "prometheus").glob("*.yml"):
        for job in (yaml.safe_load(p.read_text()) or {}).get("scrape_configs", []):
            for c in job.get("relabel_configs", []) + job.get("metric_relabel_configs", []):
                added.add(c.get("target_label", "__"))
    adapter = yaml.safe_load((deploy_dir / "k8s" / "prometheus-adapter-values.yaml").read_text())
    for rule in (adapter or {}).get("rules", {}).get("custom", []):
        added.update(rule.get("resources", {}).get("overrides", {}))
    return {x for x in added if not x.startswith("__") and "$" not in x}


def family_of(name, families):
    """The family a series name belongs to: foo_bucket -> foo when foo is a histogram."""
    for suffix in HISTOGRAM_SUFFIXES:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and families.get(base) == "histogram":
            return base
    return name


def not_allowed(used, families):
    """Messages for used names that expected_metrics.txt does not define (histograms only as
    _bucket/_sum/_count)."""
    errors = []
    for where, name in used:
        if name in SYNTHETIC:
            continue
        family = family_of(name, families)
        if family not in families:
            errors.append(f"{where}: '{name}' is not an exported metric (see expected_metrics.txt)")
        elif family == name and families[name] == "histogram":
            errors.append(f"{where}: histogram '{name}' needs _bucket, _sum or _count")
    return errors


def _closing(text, start):
    """The index of the bracket that closes text[start] (or len(text))."""
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] in "([{") - (text[i] in ")]}")
        if depth == 0:
            return i
    return len(text)


def _arguments(text, start):
    """The top-level arguments of the call whose '(' is text[start]."""
    end, args, depth, begin = _closing(text, start), [], 0, start + 1
    for i in range(start + 1, end):
        depth += (text[i] in "([{") - (text[i] in ")]}")
        if text[i] == "," and depth == 0:
            args.append(text[begin:i])
            begin = i + 1
    return args + [text[begin:end]]


def _names(text):
    return {x.strip() for x in text.split(",")} - {""}


def _buckets(expr, families):
    return {n for n in promql_metric_names(expr)
            if n.endswith("_bucket") and family_of(n, families) != n}


def promql_errors(exprs, families, labels, added):
    """For every (where, expression): labels (in matchers, groupings, label_values) that no metric
    of the expression carries and Prometheus does not add (`added`), functions applied to a
    metric of the wrong type (rate of a gauge, deriv of a counter), and a histogram_quantile
    that reads no _bucket series or aggregates le away."""
    def carried(name):  # None: not a known metric
        family = family_of(name, families)
        if family not in labels and name not in SYNTHETIC:
            return None
        le = {"le"} if _buckets(name, families) else set()
        return set(added) | labels.get(family, set()) | le

    errors = []
    for where, expr in exprs:
        names = promql_metric_names(expr)
        text = _STRING.sub('""', expr)
        used = {m.group(2) for m in _LABEL_VALUES.finditer(text)}
        text = _VARIABLE.sub(" ", _LABEL_VALUES.sub(lambda m: m.group(1) or "", text))
        for m in _GROUPING.finditer(text):
            used.update(_names(m.group(1)))
        # Grouped labels: of any metric of the expression (the matchers' ones: of their metric).
        known = [carried(n) for n in names if carried(n) is not None]
        have = set(added).union(*(known or labels.values()))  # none known: any metric's labels
        wrong = {(label, ", ".join(sorted(names))) for label in used - have}
        for m in _SELECTOR.finditer(text):
            own = carried(m.group(1) or "")
            wrong |= {(label, m.group(1) if own else ", ".join(sorted(names)))
                      for label in _MATCHER.findall(m.group(2)) if label not in (own or have)}
        for label, of in sorted(x for x in wrong if x[0] != "__name__"):
            errors.append(f"{where}: label '{label}' is on no metric of {of or 'it'} and "
                          "Prometheus does not add it")

        for m in _RANGE_CALL.finditer(text):
            func, name = m.groups()
            family = family_of(name, families)  # a histogram's _bucket/_sum/_count count up
            kind = "counter" if family != name else {"up": "gauge", **families}.get(name)
            if func in COUNTER_FUNCTIONS and kind == "gauge":
                errors.append(f"{where}: {func}() of the gauge {name} (for counters only)")
            elif func in GAUGE_FUNCTIONS and kind == "counter":
                errors.append(f"{where}: {func}() of the counter {name} (for gauges only; "
                              "rate or increase)")
        for m in re.finditer(r"\bhistogram_quantile\s*\(", text):
            arg = _arguments(text, m.end() - 1)[-1]
            if not _buckets(arg, families):
                errors.append(f"{where}: histogram_quantile() of no histogram's _bucket series")
            for agg in _AGGREGATION.finditer(arg):
                end = _closing(arg, agg.end() - 1)
                how, by = agg.groups()
                if not how:
                    after = _TRAILING_GROUPING.match(arg, end + 1)
                    how, by = after.groups() if after else (None, "")
                keeps_le = "le" in _names(by) if how == "by" else how == "without" and \
                    "le" not in _names(by)
                if _buckets(arg[agg.start():end + 1], families) and not keeps_le:
                    op = re.match(r"\w+", arg[agg.start():]).group()
                    errors.append(f"{where}: histogram_quantile() of {op}"
                                  f"{f' {how} ({by.strip()})' if how else '()'}, which drops le")
    return errors


def parse_exposition(text):
    """{family: type} from the # TYPE lines of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[:2] == ["#", "TYPE"]:
            out[parts[2]] = parts[3]
    return out


_SAMPLE = re.compile(r'([A-Za-z_:][\w:]*)\s*(\{(?:[^"{}]|"(?:[^"\\]|\\.)*")*\})?')


def parse_samples(text, types):
    """{family: label names} from the sample lines of an exposition, a histogram's
    _bucket/_sum/_count folded into its family (`types`: parse_exposition), le of its _bucket
    series left out."""
    out = {}
    for line in text.splitlines():
        m = None if line.startswith("#") else _SAMPLE.match(line)
        if m:
            name = m.group(1)
            found = set(_MATCHER.findall(_STRING.sub('""', m.group(2) or "")))
            family = family_of(name, types)
            if family != name and name.endswith("_bucket"):
                found.discard("le")
            out.setdefault(family, set()).update(found)
    return out


def exposition_errors(used, families, labels, text):
    """Expected families missing, of another type or with other labels (in the scrape `text`),
    and used names the server does not export."""
    exposed = parse_exposition(text)
    sampled = parse_samples(text, exposed)
    errors = [f"server does not export {name} ({kind})" if name not in exposed
              else f"server exports {name} as {exposed[name]}, expected {kind}"
              for name, kind in families.items() if exposed.get(name) != kind]
    for name, want in labels.items():
        got = sampled.get(name, want)  # a family without samples shows no labels
        if got != want:
            errors.append(f"server's {name} has labels {','.join(sorted(got))}, expected "
                          f"{','.join(sorted(want))} (see expected_metrics.txt)")
    for where, name in used:
        if name not in SYNTHETIC and family_of(name, exposed) not in exposed:
            errors.append(f"{where}: '{name}' is not in the server's /metrics")
    return errors


def names_of(exprs):
    """[(where, name)] for every metric name of every (where, expression)."""
    return [(where, n) for where, e in exprs for n in sorted(promql_metric_names(e))]


def used_names(deploy_dir):
    return names_of(all_exprs(deploy_dir))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deploy-dir", type=pathlib.Path, default=HERE.parent.parent / "deploy")
    ap.add_argument("--families", action="store_true",
                    help="print metric families (histogram _bucket/_sum/_count folded)")
    ap.add_argument("--check-allowed", action="store_true",
                    help="fail when a name is not in expected_metrics.txt, a label is on no "
                         "metric of its expression, or a function gets a metric of the wrong type")
    ap.add_argument("--check-exposition", metavar="FILE",
                    help="fail when the scrape in FILE ('-': stdin) lacks a used or "
                         "expected metric, or has other labels than expected")
    args = ap.parse_args()

    exprs = all_exprs(args.deploy_dir)
    used = names_of(exprs)
    families, labels = expected_families(), expected_labels()
    if args.check_allowed or args.check_exposition:
        errors = []
        if args.check_allowed:
            errors += not_allowed(used, families)
            errors += promql_errors(exprs, families, labels, added_labels(args.deploy_dir))
        if args.check_exposition:
            text = (sys.stdin.read() if args.check_exposition == "-"
                    else pathlib.Path(args.check_exposition).read_text())
            errors += exposition_errors(used, families, labels, text)
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        print(f"{len(set(n for _, n in used))} metric names checked, {len(errors)} problems")
        return 1 if errors else 0
    names = {family_of(n, families) if args.families else n for _, n in used}
    print("\n".join(sorted(names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
