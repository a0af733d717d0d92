#!/usr/bin/python3
"""Checks of deploy/ that need no Docker engine or cluster: `deploy_checks.py CHECK`, one ctest
each (tests/deploy/CMakeLists.txt). Every check prints what is wrong, naming file and field, and
exits 1; exit 77 means skipped (what it needs is not there)."""
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

import metric_names

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = pathlib.Path(os.environ.get("CEMLM_SOURCE_DIR", HERE.parent.parent))
DEPLOY = SOURCE / "deploy"
SKIP = 77
PROMTOOL = os.environ.get("PROMTOOL", "promtool")


class Errors(list):
    def expect(self, ok, message):
        if not ok:
            self.append(message)
        return ok


# --- shared facts -------------------------------------------------------------------------------

def env_table_readme():
    """{variable: flag} from the table in deploy/README.md: rows `| `CEMLM_X` | `--flag` | ...`."""
    row = re.compile(r"^\|\s*`(CEMLM_\w+)`\s*\|\s*`(--[\w-]+)`\s*\|", re.MULTILINE)
    return dict(row.findall((DEPLOY / "README.md").read_text()))


def env_table_script():
    """{variable: flag} from FLAG_TABLE in deploy/entrypoint.sh."""
    text = (DEPLOY / "entrypoint.sh").read_text()
    table = re.search(r"FLAG_TABLE='(.*?)'", text, re.DOTALL).group(1)
    return dict(line.split() for line in table.strip().splitlines())


def load_yaml_docs(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def seconds(text):
    """'40s', '1m30s', '45' or 45 -> seconds."""
    if isinstance(text, (int, float)) or re.fullmatch(r"\d+(\.\d+)?", str(text)):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s|ms)", str(text))
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in parts)


def compose_default(value):
    """What Compose substitutes for '${VAR:-default}' when VAR is unset."""
    m = re.fullmatch(r"\$\{\w+:-(.*)\}", str(value))
    return m.group(1) if m else value


def volume_target(spec):
    """The container path of a Compose short volume spec SRC:DST[:MODE] (SRC may hold ':-')."""
    parts = spec.rsplit(":", 2)
    return parts[-2] if parts[-1] in ("ro", "rw") else parts[-1]


def dockerfile_stages():
    """[(FROM line, [instructions])] of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    stages = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append((line, []))
        elif stages:  # ARGs before the first FROM only parameterise the FROM lines
            stages[-1][1].append(line)
    return stages


def image_env():
    """The ENV defaults of the final image stage."""
    env = {}
    for line in dockerfile_stages()[-1][1]:
        if line.upper().startswith("ENV "):
            env.update(re.findall(r"(\w+)=(\S+)", line))
    return env


def relabel(labels, configs):
    """One target's labels after Prometheus relabelling (the actions keep, drop and replace, with
    Prometheus' defaults); None when the target is dropped. Debian's promtool cannot run
    Kubernetes discovery, so this is how prometheus-k8s.yml's rules get tested."""
    labels = dict(labels)
    for c in configs:
        action = c.get("action", "replace")
        value = c.get("separator", ";").join(labels.get(s, "") for s in c.get("source_labels", []))
        m = re.fullmatch(c.get("regex", "(.*)"), value)  # Prometheus anchors its regexes
        if action in ("keep", "drop"):
            if (m is None) == (action == "keep"):
                return None
        elif action == "replace":
            if m:
                new = re.sub(r"\$\{?(\d+)\}?", lambda g: m.group(int(g.group(1))) or "",
                             c.get("replacement", "$1"))
                if new:
                    labels[c["target_label"]] = new
                else:  # an empty value removes the label
                    labels.pop(c["target_label"], None)
        else:
            raise ValueError(f"relabel action '{action}' is not simulated here; add it")
    return labels


def run_promtool(*args, cwd=None):
    if shutil.which(PROMTOOL) is None:
        return 1, f"promtool not found (Debian package 'prometheus'; PROMTOOL={PROMTOOL})"
    p = subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


# --- checks -------------------------------------------------------------------------------------

def check_yaml(errors):
    """Every YAML file of deploy/ and tests/deploy/ parses and holds something."""
    files = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml"), *HERE.glob("*.yml")])
    errors.expect(len(files) >= 10, f"only {len(files)} YAML files found under {DEPLOY}")
    for f in files:
        try:
            errors.expect(load_yaml_docs(f), f"{f}: empty YAML")
        except yaml.YAMLError as e:
            errors.append(f"{f}: does not parse: {e}")


def check_compose(errors):
    path = DEPLOY / "compose.yaml"
    compose = yaml.safe_load(path.read_text())
    services = compose.get("services", {})
    table, env = env_table_readme(), image_env()
    for name in ("cemlm-gpu", "cemlm-cpu"):
        s = services.get(name)
        if not errors.expect(s, f"{path}: service '{name}' missing"):
            continue
        for var in s.get("environment", {}):
            errors.expect(var in table,
                          f"{path}: {name}.environment.{var} is not a documented variable")
        errors.expect(any(volume_target(v) == env["CEMLM_MODEL"] for v in s.get("volumes", [])),
                      f"{path}: {name}.volumes does not mount {env['CEMLM_MODEL']}")
        ports = {p.split(":")[-1] for p in s.get("ports", [])}
        errors.expect({env["CEMLM_PORT"], env["CEMLM_METRICS_PORT"]} <= ports,
                      f"{path}: {name}.ports must publish the gRPC and metrics ports")
        errors.expect("cemlm" in s.get("networks", {}).get("default", {}).get("aliases", []),
                      f"{path}: {name} needs the network alias 'cemlm' (the scrape target)")
        build = s.get("build", {})
        dockerfile = path.parent / build.get("context", ".") / build.get("dockerfile", "")
        errors.expect(dockerfile.is_file(), f"{path}: {name}.build names no existing Dockerfile")
        timeout = s.get("environment", {}).get("CEMLM_SHUTDOWN_TIMEOUT", "")
        shutdown = seconds(compose_default(timeout) or env["CEMLM_SHUTDOWN_TIMEOUT"])
        grace = s.get("stop_grace_period", 10)
        errors.expect(seconds(compose_default(grace)) > shutdown,
                      f"{path}: {name}.stop_grace_period must exceed the shutdown timeout "
                      f"({shutdown:g}s)")
        # The drain time comes from the shell, so the grace period must too: a fixed one kills a
        # server mid-drain once CEMLM_SHUTDOWN_TIMEOUT is raised past it.
        errors.expect(str(grace).startswith("${CEMLM_STOP_GRACE_PERIOD:-"),
                      f"{path}: {name}.stop_grace_period must come from "
                      "${CEMLM_STOP_GRACE_PERIOD:-…}, like the drain time")
    devices = (services.get("cemlm-gpu", {}).get("deploy", {}).get("resources", {})
               .get("reservations", {}).get("devices", []))
    errors.expect(any("gpu" in d.get("capabilities", []) for d in devices),
                  f"{path}: cemlm-gpu reserves no GPU")
    for name, s in services.items():
        for v in s.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("./"):
                errors.expect((path.parent / src).exists(),
                              f"{path}: {name} mounts missing {src}")

    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job.get("static_configs", [])
               for t in sc["targets"]]
    want = f"cemlm:{env['CEMLM_METRICS_PORT']}"
    errors.expect(targets == [want], f"prometheus.yml: targets {targets}, expected {want}")
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    url = ds["datasources"][0]["url"]
    errors.expect(url == "http://prometheus:9090" and "prometheus" in services,
                  f"grafana datasource url {url} does not reach the 'prometheus' service")
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/cemlm.yaml").read_text())
    dash_path = provider["providers"][0]["options"]["path"]
    errors.expect(any(v == f"./grafana/dashboards:{dash_path}:ro"
                      for v in services.get("grafana", {}).get("volumes", [])),
                  f"grafana: dashboards provider path {dash_path} is not where "
                  "./grafana/dashboards is mounted")


def k8s_objects():
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    objs = {}
    for res in kust["resources"]:
        for doc in load_yaml_docs(DEPLOY / "k8s" / res):
            objs[(doc["kind"], doc["metadata"]["name"])] = doc
    return objs


def check_k8s(errors):
    objs = k8s_objects()
    table, image = env_table_readme(), image_env()
    cm = objs[("ConfigMap", "cemlm-config")]["data"]
    for var in cm:
        errors.expect(var in table, f"configmap.yaml: {var} is not a documented variable")
    dep = objs[("Deployment", "cemlm")]
    pod = dep["spec"]["template"]
    spec = pod["spec"]
    c = spec["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    grpc_port = int(cm.get("CEMLM_PORT", image["CEMLM_PORT"]))
    metrics_port = int(cm.get("CEMLM_METRICS_PORT", image["CEMLM_METRICS_PORT"]))
    errors.expect(ports.get("grpc") == grpc_port,
                  f"deployment.yaml: port 'grpc' is not CEMLM_PORT {grpc_port}")
    errors.expect(ports.get("metrics") == metrics_port,
                  f"deployment.yaml: port 'metrics' is not CEMLM_METRICS_PORT {metrics_port}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        errors.expect(c.get(probe, {}).get("grpc", {}).get("port") == grpc_port,
                      f"deployment.yaml: {probe} must be a grpc probe on port {grpc_port}")
    errors.expect(str(c["resources"]["limits"].get("nvidia.com/gpu")) == "1",
                  "deployment.yaml: resources.limits must request nvidia.com/gpu: 1")
    errors.expect({"configMapRef": {"name": "cemlm-config"}} in c.get("envFrom", []),
                  "deployment.yaml: envFrom must reference ConfigMap cemlm-config")
    pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    sleep = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    shutdown = seconds(cm.get("CEMLM_SHUTDOWN_TIMEOUT", image["CEMLM_SHUTDOWN_TIMEOUT"]))
    errors.expect(spec["terminationGracePeriodSeconds"] >= shutdown + sleep + 5,
                  f"deployment.yaml: terminationGracePeriodSeconds must be >= preStop {sleep:g}s + "
                  f"CEMLM_SHUTDOWN_TIMEOUT {shutdown:g}s + 5s margin")
    user = re.search(r"^USER\s+(\d+)", "\n".join(dockerfile_stages()[-1][1]), re.MULTILINE)
    errors.expect(spec["securityContext"].get("runAsNonRoot") is True and user and
                  spec["securityContext"].get("runAsUser") == int(user.group(1)),
                  "deployment.yaml: securityContext must run as non-root, as the image's USER")
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    model_dir = cm.get("CEMLM_MODEL", image["CEMLM_MODEL"])
    vols = {v["name"]: v for v in spec["volumes"]}
    claim = vols.get(mounts.get(model_dir), {}).get("persistentVolumeClaim", {}).get("claimName")
    errors.expect(("PersistentVolumeClaim", claim) in objs,
                  f"deployment.yaml: {model_dir} must be mounted from a PVC of the kustomization")
    labels = pod["metadata"]["labels"]
    errors.expect(dep["spec"]["selector"]["matchLabels"].items() <= labels.items(),
                  "deployment.yaml: selector does not match the pod labels")
    for name in ("cemlm", "cemlm-headless"):
        svc = objs[("Service", name)]["spec"]
        errors.expect(svc["selector"].items() <= labels.items(),
                      f"service {name}: selector misses the pods")
        for p in svc["ports"]:
            errors.expect(p["targetPort"] in ports,
                          f"service {name}: targetPort {p['targetPort']} is no container port")
    errors.expect(objs[("Service", "cemlm-headless")]["spec"].get("clusterIP") == "None",
                  "service cemlm-headless must be headless (clusterIP: None)")

    pdb = objs.get(("PodDisruptionBudget", "cemlm"), {}).get("spec", {})
    errors.expect(pdb.get("maxUnavailable") == 1 and
                  pdb.get("selector", {}).get("matchLabels", {}).items() <= labels.items() and
                  pdb.get("selector", {}).get("matchLabels"),
                  "pdb.yaml: a PodDisruptionBudget cemlm must let one pod go at a time "
                  "(maxUnavailable: 1) and select the pods")

    hpa = objs[("HorizontalPodAutoscaler", "cemlm")]["spec"]
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "cemlm"}
    errors.expect(hpa["scaleTargetRef"] == target,
                  "hpa.yaml: scaleTargetRef must be Deployment cemlm")
    errors.expect("replicas" not in dep["spec"],
                  "deployment.yaml: the HPA owns the replica count; a `replicas` field would reset "
                  "it at every kubectl apply")
    adapter = yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter-values.yaml").read_text())
    published = {r["name"]["as"] for r in adapter["rules"]["custom"]}
    for m in hpa["metrics"]:
        errors.expect(m["type"] == "Pods" and m["pods"]["metric"]["name"] in published,
                      f"hpa.yaml: metric {m} is not published by prometheus-adapter-values.yaml")
    k8s_prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text())
    job = k8s_prom["scrape_configs"][0]
    added = {r.get("target_label") for r in job["relabel_configs"]}
    errors.expect(job["job_name"] == "cemlm" and {"namespace", "pod"} <= added,
                  "prometheus-k8s.yml: job 'cemlm' must add the labels namespace and pod "
                  "(the adapter rule needs them)")
    # Pods discovered with an IP: only running cemlm pods' metrics port is a target. A pod still
    # pulling its image (Pending) or evicted (Failed; it lingers until garbage-collected) has an
    # IP but nothing listening: scraped, it is up == 0, and CemlmServerDown fires for it.
    def pod_target(phase="Running", app="cemlm", port="metrics"):
        return {"__address__": "10.0.0.7:9400", "__meta_kubernetes_namespace": "ml",
                "__meta_kubernetes_pod_name": "cemlm-abc", "__meta_kubernetes_pod_phase": phase,
                "__meta_kubernetes_pod_label_app_kubernetes_io_name": app,
                "__meta_kubernetes_pod_container_port_name": port}
    kept = relabel(pod_target(), job["relabel_configs"])
    errors.expect(kept and kept.get("namespace") == "ml" and kept.get("pod") == "cemlm-abc",
                  f"prometheus-k8s.yml: a running cemlm pod's metrics port is not scraped with "
                  f"namespace and pod labels: {kept}")
    for why, target in (("a Pending pod", pod_target(phase="Pending")),
                        ("a Failed (evicted) pod", pod_target(phase="Failed")),
                        ("a Succeeded pod", pod_target(phase="Succeeded")),
                        ("another app's pod", pod_target(app="other")),
                        ("the grpc port", pod_target(port="grpc"))):
        errors.expect(relabel(target, job["relabel_configs"]) is None,
                      f"prometheus-k8s.yml: job 'cemlm' scrapes {why}; drop it in "
                      "relabel_configs (__meta_kubernetes_pod_phase)")


def check_dashboard(errors):
    path = DEPLOY / "grafana" / "dashboards" / "cemlm.json"
    try:
        dash = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        errors.append(f"{path}: does not parse: {e}")
        return
    ids = [p["id"] for p in dash["panels"]]
    errors.expect(len(ids) == len(set(ids)), f"{path}: panel ids repeat: {ids}")
    for p in dash["panels"]:
        for t in p.get("targets", []):
            errors.expect(t.get("datasource", {}).get("uid") == "${datasource}",
                          f"{path}: panel '{p['title']}' {t['refId']} must use $datasource")
    exprs = metric_names.dashboard_exprs(path)
    families = metric_names.expected_families()
    used = metric_names.names_of(exprs)
    errors.extend(metric_names.not_allowed(used, families))
    errors.extend(metric_names.promql_errors(exprs, families, metric_names.expected_labels(),
                                             metric_names.added_labels(DEPLOY)))
    shown = {metric_names.family_of(n, families) for _, n in used}
    for family in families:
        errors.expect(family in shown, f"{path}: no panel shows {family}")
    joined = "\n".join(e for _, e in exprs)
    for hist in ("time_to_first_token", "inter_token_latency", "e2e_request_latency",
                 "score_request_latency"):
        p99 = rf"histogram_quantile\(0\.99,[^\n]*cemlm:{hist}_seconds_bucket"
        errors.expect(re.search(p99, joined), f"{path}: no p99 (histogram_quantile) of {hist}")
    errors.expect(any(p["type"] in ("heatmap", "bargauge")
                      and "recursion_depth_bucket" in json.dumps(p) for p in dash["panels"]),
                  f"{path}: no distribution panel of recursion depth T")
    # A query filtered with `> 0` has gaps; a value alone between two is drawn only as a point,
    # so such a panel must not hide its points (a single error burst was invisible).
    for p in dash["panels"]:
        gaps = any(t.get("expr", "").rstrip().endswith("> 0") for t in p.get("targets", []))
        points = p.get("fieldConfig", {}).get("defaults", {}).get("custom", {}).get("showPoints")
        errors.expect(not gaps or points != "never",
                      f"{path}: panel {p.get('title')!r} filters with > 0 but never shows points")
    # An increase() over a rate window wider than the panel's step counts a sample in several
    # steps (the recursion-depth heatmap counted each request up to 4 times): rates instead.
    for _, e in exprs:
        errors.expect(not re.search(r"increase\([^\]]*\[\$__rate_interval\]", e),
                      f"{path}: increase() over $__rate_interval counts samples twice: {e}")
    # promtool has no bare PromQL parser: wrap each panel query as a recording rule.
    grafana_vars = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "1m",
                    "$model": ".*", "$instance": ".*"}
    rules = []
    for i, (_, e) in enumerate(x for x in exprs if "label_values(" not in x[1]):
        for var, value in grafana_vars.items():
            e = e.replace(var, value)
        rules.append({"record": f"dashboard:query_{i}", "expr": e})
    with tempfile.TemporaryDirectory() as tmp:
        f = pathlib.Path(tmp) / "dashboard_rules.yml"
        f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
        rc, out = run_promtool("check", "rules", str(f))
        errors.expect(rc == 0, f"{path}: a panel query is not valid PromQL:\n{out}")


def check_prometheus(errors):
    prom = DEPLOY / "prometheus"
    rc, out = run_promtool("check", "config", str(prom / "prometheus.yml"))
    errors.expect(rc == 0 and "1 rule files found" in out, f"promtool check config:\n{out}")
    rule_files = sorted((prom / "rules").glob("*.yml"))
    rc, out = run_promtool("check", "rules", *map(str, rule_files))
    errors.expect(rc == 0, f"promtool check rules:\n{out}")
    rc, out = run_promtool("test", "rules", "alerts_test.yml", cwd=HERE)
    errors.expect(rc == 0, f"promtool test rules alerts_test.yml:\n{out}")
    alerts = {r["alert"] for f in rule_files for g in yaml.safe_load(f.read_text())["groups"]
              for r in g["rules"]}
    for need in ("ServerDown", "HighErrorRate", "QueueGrowing", "KvCacheSaturated"):
        errors.expect(f"Cemlm{need}" in alerts, f"rules: alert Cemlm{need} missing")
    # Every alert is tested firing on what it is named for, and quiet on an idle server.
    cases = [c for t in yaml.safe_load((HERE / "alerts_test.yml").read_text())["tests"]
             for c in t.get("alert_rule_test", [])]
    for alert in sorted(alerts):
        errors.expect(any(c["alertname"] == alert and c.get("exp_alerts") for c in cases),
                      f"alerts_test.yml: no case where {alert} fires")
        errors.expect(any(c["alertname"] == alert and not c.get("exp_alerts") for c in cases),
                      f"alerts_test.yml: no case where {alert} stays quiet")
    exprs = [x for f in rule_files for x in metric_names.rule_exprs(f)]
    exprs += metric_names.adapter_exprs(DEPLOY / "k8s" / "prometheus-adapter-values.yaml")
    families = metric_names.expected_families()
    errors.extend(metric_names.not_allowed(metric_names.names_of(exprs), families))
    errors.extend(metric_names.promql_errors(exprs, families, metric_names.expected_labels(),
                                             metric_names.added_labels(DEPLOY)))
    for path in (prom / "prometheus.yml", prom / "prometheus-k8s.yml"):
        jobs = [j["job_name"] for j in yaml.safe_load(path.read_text())["scrape_configs"]]
        errors.expect(jobs == ["cemlm"],
                      f"{path}: scrape job must be 'cemlm' (the rules select it), not {jobs}")


def check_dockerfile(errors):
    path = DEPLOY / "Dockerfile"
    stages = dockerfile_stages()
    errors.expect(len([s for s in stages if s[1]]) >= 2, f"{path}: not multi-stage")
    final = stages[-1][1]

    def keyword(k):
        return [line for line in final if line.split()[0].upper() == k]

    users = keyword("USER")
    errors.expect(users and re.fullmatch(r"USER\s+[1-9]\d*(:[1-9]\d*)?", users[-1]),
                  f"{path}: the final stage must end as a numeric non-root USER, got {users}")
    health = keyword("HEALTHCHECK")
    errors.expect(health and "health" in health[-1] and "cemlm-entrypoint" in health[-1],
                  f"{path}: the final stage needs HEALTHCHECK running the entrypoint's health mode")
    errors.expect(any("cemlm-entrypoint" in e for e in keyword("ENTRYPOINT")),
                  f"{path}: ENTRYPOINT must be the entrypoint script")
    errors.expect(any("/models/default" in v for v in keyword("VOLUME")),
                  f"{path}: no VOLUME /models/default")
    for line in keyword("RUN"):
        errors.expect(not re.search(r"install\b.*\S+-dev\b", line),
                      f"{path}: the final stage installs a -dev package: {line}")
    env = image_env()
    table = env_table_readme()
    for var in env:
        errors.expect(var in table or var == "CEMLM_BIN",
                      f"{path}: ENV {var} is not a documented variable")
    exposed = {p for line in keyword("EXPOSE") for p in line.split()[1:]}
    errors.expect({env.get("CEMLM_PORT"), env.get("CEMLM_METRICS_PORT")} <= exposed,
                  f"{path}: EXPOSE {exposed} must include CEMLM_PORT and CEMLM_METRICS_PORT")
    build = "\n".join(line for _, body in stages[:-1] for line in body)
    errors.expect("-DCEMLM_CUDA=" in build and "runtime-packages.sh" in build,
                  f"{path}: the build stage must set CEMLM_CUDA and list runtime packages")
    for src in re.findall(r"\b(deploy/[\w./-]+)", build):
        errors.expect((SOURCE / src).exists(), f"{path}: refers to missing {src}")
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    errors.expect({".git", "build*/"} <= set(ignore),
                  "Dockerfile.dockerignore must leave out .git and build*/")


def run_entrypoint(tmp, args, env, rc=0):
    """Runs deploy/entrypoint.sh with a stub cemlm that records its arguments."""
    record = tmp / "args.json"
    record.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("CEMLM_")}
    base.update({"CEMLM_BIN": str(tmp / "cemlm"), "STUB_RECORD": str(record), "STUB_RC": str(rc)})
    base.update(env)
    p = subprocess.run(["bash", str(DEPLOY / "entrypoint.sh"), *args], env=base,
                       capture_output=True, text=True)
    argv = json.loads(record.read_text()) if record.exists() else None
    return p.returncode, argv, p.stderr


def check_entrypoint(errors):
    readme, script = env_table_readme(), env_table_script()
    errors.expect(readme == script, "README.md and entrypoint.sh list different variables/flags: "
                  f"only README {sorted(readme.items() - script.items())}, "
                  f"only script {sorted(script.items() - readme.items())}")
    errors.expect(len(readme) >= 14, f"README.md documents only {len(readme)} variables")
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d)
        stub = tmp / "cemlm"
        stub.write_text("#!/usr/bin/python3\nimport json, os, sys\n"
                        "open(os.environ['STUB_RECORD'], 'w').write(json.dumps(sys.argv[1:]))\n"
                        "sys.exit(int(os.environ['STUB_RC']))\n")
        stub.chmod(0o755)
        values = {var: f"value of {var}" for var in readme}  # spaces must survive as one argument
        rc, argv, err = run_entrypoint(tmp, [], values)
        if errors.expect(rc == 0 and argv, f"entrypoint with all variables failed ({rc}): {err}"):
            errors.expect(argv[0] == "serve", f"entrypoint did not run 'serve': {argv}")
            pairs = dict(zip(argv[1::2], argv[2::2]))
            for var, flag in readme.items():
                errors.expect(pairs.get(flag) == values[var],
                              f"{var} did not become {flag}: {argv}")
            errors.expect(len(argv) == 1 + 2 * len(readme), f"unexpected extra arguments: {argv}")

        rc, argv, _ = run_entrypoint(tmp, ["serve", "--max-waiting", "7"],
                                     {"CEMLM_PORT": "", "CEMLM_THREADS": "3",
                                      "CEMLM_EXTRA_ARGS": "--log-level debug"})
        want = ["serve", "--threads", "3", "--log-level", "debug", "--max-waiting", "7"]
        errors.expect(argv == want,
                      f"empty variables, CEMLM_EXTRA_ARGS or extra flags mishandled: {argv}")
        rc, argv, _ = run_entrypoint(tmp, ["--max-waiting", "9"], {})
        errors.expect(argv == ["serve", "--max-waiting", "9"],
                      f"leading flags must go to serve: {argv}")
        # The health check reads CEMLM_PORT/CEMLM_HOST: the flags would leave it probing elsewhere.
        for args, env, var in ((["--port", "6000"], {}, "CEMLM_PORT"),
                               (["serve", "--host=10.0.0.1"], {}, "CEMLM_HOST"),
                               ([], {"CEMLM_EXTRA_ARGS": "--log-level debug --port 6000"},
                                "CEMLM_PORT")):
            rc, argv, err = run_entrypoint(tmp, args, env)
            errors.expect(rc == 2 and argv is None and var in err,
                          f"{args} {env} must be refused naming {var} (rc {rc}): {err}")
        rc, argv, _ = run_entrypoint(tmp, ["inspect", "/models/default"], {})
        errors.expect(argv == ["inspect", "/models/default"],
                      f"other commands must pass through: {argv}")

        rc, argv, _ = run_entrypoint(tmp, ["health"], {})
        errors.expect(argv == ["client", "health", "--addr", "127.0.0.1:50051"],
                      f"health default: {argv}")
        rc, argv, _ = run_entrypoint(tmp, ["health"],
                                     {"CEMLM_HOST": "10.1.2.3", "CEMLM_PORT": "7000"})
        errors.expect(argv == ["client", "health", "--addr", "10.1.2.3:7000"],
                      f"health on a bound host: {argv}")
        for host, addr in (("::1", "[::1]:7000"), ("[fd00::2]", "[fd00::2]:7000")):
            rc, argv, _ = run_entrypoint(tmp, ["health"], {"CEMLM_HOST": host, "CEMLM_PORT": "7000"})
            errors.expect(argv == ["client", "health", "--addr", addr],
                          f"health on IPv6 host {host}: {argv}")
        health_env = {"CEMLM_HEALTH_ADDR": "h:1", "CEMLM_HEALTH_ARGS": "--a b"}
        rc, argv, _ = run_entrypoint(tmp, ["health"], health_env, rc=3)
        errors.expect(rc == 3 and argv == ["client", "health", "--addr", "h:1", "--a", "b"],
                      f"health must pass CEMLM_HEALTH_* and return the check's status "
                      f"(rc {rc}): {argv}")

        rc, argv, err = run_entrypoint(tmp, [], {"CEMLM_BIN": str(tmp / "missing")})
        errors.expect(rc == 127 and argv is None and "CEMLM_BIN" in err,
                      f"a missing program must fail naming CEMLM_BIN (rc {rc}): {err}")


def check_runtime_packages(errors):
    script = str(DEPLOY / "runtime-packages.sh")
    if shutil.which("dpkg-query") is None:
        print("skipped: dpkg-query not found (not a Debian/Ubuntu system)")
        sys.exit(SKIP)
    ls = shutil.which("ls")
    p = subprocess.run(["bash", script, ls], capture_output=True, text=True)
    packages = p.stdout.split()
    errors.expect(p.returncode == 0 and "libc6" in packages and all(":" not in x for x in packages),
                  f"runtime-packages.sh {ls}: rc {p.returncode}, packages {packages}, {p.stderr}")
    libs = [line.split() for line in subprocess.run(["ldd", ls], capture_output=True, text=True)
            .stdout.splitlines()]
    lib = next((x for x in libs
                if len(x) >= 3 and x[1] == "=>" and not x[0].startswith("libc.so")), None)
    if lib:  # a copy outside every package must be reported, not silently left out
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(lib[2], tmp)
            p = subprocess.run(["bash", script, ls], capture_output=True, text=True,
                               env={**os.environ, "LD_LIBRARY_PATH": tmp})
            errors.expect(p.returncode == 1 and lib[0] in p.stderr,
                          f"runtime-packages.sh must fail naming {lib[0]}: "
                          f"rc {p.returncode}, {p.stderr}")
    p = subprocess.run(["bash", script, ls, "/nonexistent"], capture_output=True, text=True)
    errors.expect(p.returncode == 2 and "/nonexistent" in p.stderr,
                  "runtime-packages.sh: bad argument not refused")
    p = subprocess.run(["bash", script], capture_output=True, text=True)
    errors.expect(p.returncode == 2 and "usage" in p.stderr,
                  "runtime-packages.sh: missing argument not refused")


def check_metric_names(errors):
    """metric_names.py --check-exposition accepts a scrape with every family and its labels and
    names what a scrape lacks or mislabels (the live check and the lead's scrape comparison rely
    on it); the PromQL checks accept deploy/ and refuse an unknown label or a misused type."""
    families, labels = metric_names.expected_families(), metric_names.expected_labels()

    def block(name, kind):  # one family of a scrape: its TYPE line and a sample of each series
        values = ",".join(f'{x}="v"' for x in sorted(labels[name]))
        series = ([f'{name}_bucket{{{values},le="+Inf"}} 0', f"{name}_sum{{{values}}} 0",
                   f"{name}_count{{{values}}} 0"] if kind == "histogram"
                  else [f"{name}{{{values}}} 0"])
        return "\n".join([f"# TYPE {name} {kind}", *series])

    blocks = [block(name, kind) for name, kind in families.items()]
    script = [sys.executable, str(HERE / "metric_names.py"), "--deploy-dir", str(DEPLOY)]

    def check(scrape_blocks):
        return subprocess.run([*script, "--check-exposition", "-"], input="\n".join(scrape_blocks),
                              capture_output=True, text=True)

    p = check(blocks)
    errors.expect(p.returncode == 0, f"a complete scrape was refused: {p.stderr}")
    p = check(blocks[1:])
    missing = blocks[0].split()[2]
    errors.expect(p.returncode == 1 and missing in p.stderr,
                  f"a scrape without {missing} was accepted")
    p = check([x.replace(" histogram", " summary") for x in blocks])
    errors.expect(p.returncode == 1 and "expected histogram" in p.stderr,
                  "a wrong metric type was accepted")
    p = check([x.replace("code=", "grpc_code=") for x in blocks])
    errors.expect(p.returncode == 1 and "requests_total has labels grpc_code,method,model_name, "
                  "expected code,method,model_name" in p.stderr,
                  f"a scrape with the label code renamed grpc_code was accepted: {p.stderr}")
    p = check([x.replace("_sum{", '_sum{le="1",') for x in blocks])
    errors.expect(p.returncode == 1 and "has labels le,model_name, expected model_name" in p.stderr,
                  f"a scrape with le on a histogram's _sum was accepted: {p.stderr}")

    exprs = metric_names.all_exprs(DEPLOY)
    added = metric_names.added_labels(DEPLOY)
    errors.expect(len(exprs) > 10 and {"namespace", "pod"} <= added,
                  f"only {len(exprs)} deploy/ expressions, labels Prometheus adds: {added}")
    found = metric_names.promql_errors(exprs, families, labels, added)
    errors.expect(not found, f"deploy/'s expressions were refused: {found}")
    for expr, why in (
            ("sum by (grpc_code) (rate(cemlm:requests_total[5m]))", "label 'grpc_code'"),
            ('cemlm:num_requests_waiting{pod=~"x", podname="y"}', "label 'podname'"),
            ('rate(cemlm:request_errors_total{code="INTERNAL"}[5m]) / '
             'rate(cemlm:requests_total{grpc_code="OK"}[5m])', "label 'grpc_code'"),
            ("rate(cemlm:num_requests_waiting[5m])", "rate() of the gauge"),
            ("deriv(cemlm:requests_total[5m])", "deriv() of the counter"),
            ("histogram_quantile(0.9, sum by (model_name) "
             "(rate(cemlm:e2e_request_latency_seconds_bucket[5m])))", "drops le"),
            ("histogram_quantile(0.9, sum(rate(cemlm:e2e_request_latency_seconds_sum[5m])))",
             "no histogram's _bucket")):
        found = metric_names.promql_errors([("test", expr)], families, labels, added)
        errors.expect(any(why in e for e in found), f"{expr} not refused for {why}: {found}")
    p = subprocess.run([*script, "--families"], capture_output=True, text=True)
    errors.expect(p.returncode == 0 and set(p.stdout.split()) == set(families) | {"up"},
                  f"--families must print every family: {p.stdout}")


def check_shellcheck(errors):
    """The shell scripts of deploy/ pass shellcheck (skipped without the Debian package)."""
    if shutil.which("shellcheck") is None:
        print("skipped: shellcheck not found (Debian package shellcheck)")
        sys.exit(SKIP)
    scripts = sorted(map(str, DEPLOY.glob("*.sh")))
    p = subprocess.run(["shellcheck", "--shell=bash", *scripts], capture_output=True, text=True)
    errors.expect(p.returncode == 0, f"shellcheck {' '.join(scripts)}:\n{p.stdout}{p.stderr}")


TINY_CONFIG = {
    "architecture": "cemlm", "format_version": 1,
    "vocab_size": 64, "d_model": 16, "n_layers": 1, "n_heads": 2, "head_dim": 8, "d_ff": 32,
    "max_seq_len": 64, "norm_eps": 1e-5, "rope_theta": 10000.0,
    "embedding": {"type": "table", "tie_output": False},
    "attention": {"type": "cem", "diag": "shared", "precond_rank": 2},
    "mlp": {"type": "cem", "precond_rank": 2},
    "recursion": {"default": 2, "max": 4, "step_size": "inverse_T"},
    "bos_id": 1, "eos_id": 2,
}


def free_ports(n):
    """n ports free on 127.0.0.1, all different: each socket stays bound until all are picked
    (bound and closed one at a time, the system could hand out the same port twice)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def serving(binary):
    """Exits as skipped unless CEMLM_BIN is built and has `serve`."""
    if not os.access(binary, os.X_OK):
        print(f"skipped: CEMLM_BIN='{binary}' is not built")
        sys.exit(SKIP)
    p = subprocess.run([binary, "serve", "--help"], capture_output=True, text=True)
    if p.returncode != 0:
        print(f"skipped: '{binary} serve --help' failed ({p.returncode}): {p.stderr.strip()}")
        sys.exit(SKIP)
    return p.stdout


def wait_serving(entrypoint, env, server, deadline_s):
    """Polls the entrypoint's health mode until SERVING; False when the server died or the
    deadline passed (a bound, so a hung server cannot outlive the test)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and server.poll() is None:
        if subprocess.run([*entrypoint, "health"], env=env, capture_output=True).returncode == 0:
            return True
        time.sleep(0.2)
    return False


def check_live(errors):
    """The entrypoint serves a random-init model outside Docker over TLS (the certificate's
    gauge is exported only then), passes its own health check, exports every metric the
    dashboard and rules use, and drains on SIGTERM."""
    binary = os.environ.get("CEMLM_BIN", "")
    serving(binary)
    entrypoint = ["bash", str(DEPLOY / "entrypoint.sh")]
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d)
        (tmp / "config.json").write_text(json.dumps(TINY_CONFIG))
        p = subprocess.run([binary, "init", "--config", str(tmp / "config.json"),
                            "--out", str(tmp / "model")], capture_output=True, text=True)
        if not errors.expect(p.returncode == 0, f"cemlm init failed: {p.stderr}"):
            return
        cert, key = tmp / "cert.pem", tmp / "key.pem"
        p = subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                            "ec_paramgen_curve:P-256", "-nodes", "-days", "30", "-subj",
                            "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                            "-keyout", str(key), "-out", str(cert)],
                           capture_output=True, text=True)
        if not errors.expect(p.returncode == 0, "openssl could not make a certificate (the "
                             f"tests' setup installs it: CEMLM_SETUP_TESTS=1): {p.stderr}"):
            return
        port, metrics_port = free_ports(2)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CEMLM_")}
        env.update(CEMLM_BIN=binary, CEMLM_MODEL=str(tmp / "model"), CEMLM_DEVICE="cpu",
                   CEMLM_HOST="127.0.0.1", CEMLM_PORT=str(port),
                   CEMLM_METRICS_PORT=str(metrics_port), CEMLM_KV_CACHE_MEMORY="16M",
                   CEMLM_THREADS="1", CEMLM_SHUTDOWN_TIMEOUT="10", CEMLM_LOG_LEVEL="warn",
                   CEMLM_TLS_CERT=str(cert), CEMLM_TLS_KEY=str(key),
                   CEMLM_HEALTH_ARGS=f"--tls-ca {cert}")
        log_path = tmp / "log"
        with open(log_path, "w") as log:
            server = subprocess.Popen(entrypoint, env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            if not errors.expect(wait_serving(entrypoint, env, server, 60),
                                 f"server not SERVING: {log_path.read_text()}"):
                return
            generate = [binary, "client", "generate", "--addr", f"127.0.0.1:{port}",
                        "--tls-ca", str(cert), "--prompt-ids", "3,4,5", "--max-new-tokens", "3",
                        "--json"]
            p = subprocess.run(generate, capture_output=True, text=True)
            errors.expect(p.returncode == 0, f"generate failed: {p.stderr}")
            # Over the model's recursion max: INVALID_ARGUMENT, which fills errors by code.
            p = subprocess.run([*generate, "--recursion", "99"], capture_output=True, text=True)
            errors.expect(p.returncode != 0, "generate with --recursion 99 was not refused")
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as r:
                scrape = r.read().decode()
            errors.extend(metric_names.exposition_errors(
                metric_names.used_names(DEPLOY), metric_names.expected_families(),
                metric_names.expected_labels(), scrape))
            errors.expect('model_name="model"' in scrape, "metrics lack the label model_name")
        finally:
            server.terminate()  # SIGTERM: the entrypoint exec'd the server, so it drains
            try:
                rc = server.wait(timeout=30)
                errors.expect(rc == 0, f"server exited {rc} after SIGTERM: {log_path.read_text()}")
            except subprocess.TimeoutExpired:
                server.kill()
                errors.append("server did not exit within 30 s of SIGTERM")


def check_serve_flags(errors):
    """Every `cemlm serve` flag has a variable and every variable a flag (skipped until the server
    is built)."""
    help_text = serving(os.environ.get("CEMLM_BIN", ""))
    flags = set(re.findall(r"^  (--[\w-]+)", help_text, re.MULTILINE)) - {"--help"}
    table = set(env_table_readme().values())
    errors.expect(flags <= table,
                  f"serve flags without a CEMLM_* variable: {sorted(flags - table)}")
    errors.expect(table <= flags, f"variables for flags serve lacks: {sorted(table - flags)}")


CHECKS = {name[len("check_"):]: f for name, f in globals().items() if name.startswith("check_")}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        print(f"usage: deploy_checks.py {{{','.join(CHECKS)}}}", file=sys.stderr)
        return 2
    errors = Errors()
    CHECKS[sys.argv[1]](errors)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    print(f"deploy check '{sys.argv[1]}': {'FAILED' if errors else 'ok'} ({len(errors)} problems)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
