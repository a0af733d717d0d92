#!/usr/bin/python3
"""Metric names used by deploy/: the Grafana dashboards, the Prometheus alert rules and the
prometheus-adapter rule. Prints them (one a line), checks them against expected_metrics.txt
(--check-allowed), or against a scrape of a live server (--check-exposition FILE, '-' for stdin).
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
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_OFFSET = re.compile(r"\boffset\s+-?\w+")
_VARIABLE = re.compile(r"\$\{?\w+(?::\w+)?\}?")
# Grafana's templating function: label_values(metric_selector, label) or label_values(label).
_LABEL_VALUES = re.compile(r"label_values\(\s*(?:(.*?)\s*,\s*)?\w+\s*\)")
_TOKEN = re.compile(r"\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"}


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


def expected_families(path=HERE / "expected_metrics.txt"):
    """{family name: type} from expected_metrics.txt."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, kind = line.split()
            out[name] = kind
    return out


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


def parse_exposition(text):
    """{family: type} from the # TYPE lines of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[:2] == ["#", "TYPE"]:
            out[parts[2]] = parts[3]
    return out


def exposition_errors(used, families, exposed):
    """Expected families missing or of another type, and used names the server does not export."""
    errors = [f"server does not export {name} ({kind})" if name not in exposed
              else f"server exports {name} as {exposed[name]}, expected {kind}"
              for name, kind in families.items() if exposed.get(name) != kind]
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
                    help="fail when a name is not in expected_metrics.txt")
    ap.add_argument("--check-exposition", metavar="FILE",
                    help="fail when the scrape in FILE ('-': stdin) lacks a used or "
                         "expected metric")
    args = ap.parse_args()

    used = used_names(args.deploy_dir)
    families = expected_families()
    if args.check_allowed or args.check_exposition:
        errors = not_allowed(used, families) if args.check_allowed else []
        if args.check_exposition:
            text = (sys.stdin.read() if args.check_exposition == "-"
                    else pathlib.Path(args.check_exposition).read_text())
            errors += exposition_errors(used, families, parse_exposition(text))
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        print(f"{len(set(n for _, n in used))} metric names checked, {len(errors)} problems")
        return 1 if errors else 0
    names = {family_of(n, families) if args.families else n for _, n in used}
    print("\n".join(sorted(names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
