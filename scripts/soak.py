#!/usr/bin/python3
"""Soak test of `cemlm serve`: abusive mixed traffic for a while, then the server must be idle again.

Starts `cemlm serve` with a small KV cache (preemption) and a short queue (refusals), and drives it
from threads of this process: streamed Generates of T 1-8 with mixed lengths and priorities (read
out, cancelled after a few messages, short deadlines, slow readers), Score calls of long texts
(some cancelled or with short deadlines), invalid requests of every kind, bodies that do not
parse or exceed 4 MiB, Tokenize/Detokenize/GetModelInfo, `cemlm client generate` processes killed
with SIGKILL mid-stream, bursts past --max-running + --max-waiting, and batches of streams left
unread behind a small HTTP/2 window. Every --sample seconds it prints the server's RSS, open fds,
threads and the /metrics gauges; after the load, the client-side and server-side request counts by
method and code. Exits 1 when the idle server still runs, queues, holds KV blocks or unread streams,
holds more fds than at the start, or logged a warning or error, or when SIGTERM does not end it
with 0. It is a benchmark-like program (numbers to read), not a test: docs/BENCHMARKS.md.

    /usr/bin/python3 scripts/soak.py --minutes 13 --model models/default --out /tmp/soak

Needs python3-grpcio and python3-protobuf, and protoc + grpc_python_plugin for the stubs (as
examples/python_client.py). Calls of killed clients are not counted client-side (their outcome is
unknown; the server counts them, mostly CANCELLED, or not at all when the kill came before the call
was sent), and per-code counts may differ by the calls that ended in the transit window (a client
deadline or cancel racing the server's answer); the Score calls over 4 MiB are refused by gRPC
before the service sees them (not in requests_total), as docs/API.md says.
"""
import argparse
import collections
import importlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
grpc = pb = pbg = None  # imported in main(), once the stubs exist
ADDR = CEMLM = None
stop = threading.Event()
lock = threading.Lock()
counts = collections.Counter()  # (method, code) as the client saw it
extra = collections.Counter()   # calls not in requests_total, or of unknown outcome
TEXT = open("/usr/share/games/fortunes/fortunes", encoding="utf-8", errors="replace").read()


def note(method, code):
    with lock:
        counts[(method, code)] += 1


def text(nbytes):
    i = random.randrange(0, len(TEXT) - nbytes - 1)
    return TEXT[i:i + nbytes].encode()


channels = []  # closed once the load stops, so that the idle server holds no connection of ours


def chan(options=(("grpc.max_send_message_length", 8 << 20),)):
    ch = grpc.insecure_channel(ADDR, options=list(options))
    with lock:
        channels.append(ch)
    return ch


def code_of(e):
    return e.code().name if isinstance(e, grpc.RpcError) else "PYEXC:" + type(e).__name__


def gen_request():
    s = pb.SamplingParams(max_new_tokens=random.choice([1, 4, 16, 48, 96, 200]),
                          seed=random.randrange(1 << 30))
    if random.random() < 0.3:
        s.temperature = random.choice([0.0, 0.7, 1.3])
    if random.random() < 0.2:
        s.top_k = 20
        s.top_p = 0.9
    if random.random() < 0.2:
        s.stop.append(b"\n")
    r = pb.GenerateRequest(recursion_depth=random.randint(1, 8), sampling=s,
                           priority=random.choice([-1, 0, 0, 1, 2]),
                           request_id="soak-%d" % random.randrange(1 << 30))
    if random.random() < 0.5:
        r.prompt_text = text(random.choice([5, 40, 200, 800]))
    else:
        r.prompt_ids.extend(random.randrange(4, 4096) for _ in range(random.randint(1, 200)))
    if random.random() < 0.3:
        r.logprobs = True
        r.sampling.top_logprobs = random.choice([0, 5])
    return r


def run_generate(stub, req, timeout=None, cancel_after=None, slow=0.0):
    try:
        call = stub.Generate(req, timeout=timeout)
        n = 0
        for _ in call:
            n += 1
            if slow:
                time.sleep(slow)
            if cancel_after is not None and n >= cancel_after:
                call.cancel()
                note("Generate", "CANCELLED")
                return
        note("Generate", "OK")
    except grpc.RpcError as e:
        note("Generate", code_of(e))


def worker_stream():
    stub = pbg.InferenceStub(chan())
    while not stop.is_set():
        r = random.random()
        req = gen_request()
        if r < 0.55:
            run_generate(stub, req, timeout=60)
        elif r < 0.7:
            run_generate(stub, req, timeout=random.choice([0.02, 0.1, 0.3, 1.0]))
        elif r < 0.85:
            run_generate(stub, req, timeout=60, cancel_after=random.randint(1, 5))
        else:
            run_generate(stub, req, timeout=60, slow=random.choice([0.05, 0.3]))


def worker_score():
    stub = pbg.InferenceStub(chan())
    while not stop.is_set():
        req = pb.ScoreRequest(recursion_depth=random.randint(1, 8),
                              priority=random.choice([-1, 0, 1, 3]))
        if random.random() < 0.5:
            req.text = text(random.choice([100, 500, 1500, 2000]))
        else:
            req.ids.extend(random.randrange(4, 4096) for _ in range(random.randint(2, 512)))
        timeout = random.choice([60, 60, 60, 0.05, 0.5])
        try:
            if random.random() < 0.15:
                fut = stub.Score.future(req, timeout=60)
                time.sleep(random.choice([0.01, 0.1, 0.3]))
                if fut.cancel():
                    note("Score", "CANCELLED")
                    continue
                fut.result()
            else:
                stub.Score(req, timeout=timeout)
            note("Score", "OK")
        except grpc.FutureCancelledError:
            note("Score", "CANCELLED")
        except grpc.RpcError as e:
            note("Score", code_of(e))


def bad_generates():
    big = pb.GenerateRequest(prompt_ids=[5] * 600)  # over max_seq_len 512
    yield big
    yield pb.GenerateRequest(prompt_text=b"hi", sampling=pb.SamplingParams(top_p=1.5))
    yield pb.GenerateRequest(prompt_text=b"hi", sampling=pb.SamplingParams(temperature=-1))
    yield pb.GenerateRequest(prompt_text=b"hi", recursion_depth=9)
    yield pb.GenerateRequest(prompt_text=b"hi", recursion_depth=-3)
    yield pb.GenerateRequest(prompt_ids=[1, 99999])
    yield pb.GenerateRequest(prompt_ids=[-5])
    yield pb.GenerateRequest(prompt_text=b"hi", prompt_ids=[1])
    yield pb.GenerateRequest()
    yield pb.GenerateRequest(prompt_text=b"\xff\xfe bad")
    yield pb.GenerateRequest(prompt_text=b"hi", sampling=pb.SamplingParams(max_new_tokens=100000))
    yield pb.GenerateRequest(prompt_text=b"hi", sampling=pb.SamplingParams(top_logprobs=5))
    yield pb.GenerateRequest(prompt_text=b"hi", request_id="x" * 300)
    yield pb.GenerateRequest(prompt_text=b"hi", sampling=pb.SamplingParams(stop=[b"a"] * 17))
    yield pb.GenerateRequest(prompt_text=b"hi", sampling=pb.SamplingParams(logit_bias={99999: 1}))
    yield pb.GenerateRequest(prompt_text=b"hi",
                             sampling=pb.SamplingParams(min_new_tokens=50, max_new_tokens=10))
    yield pb.GenerateRequest(prompt_text=b"x" * 200000)  # over the text bound
    yield pb.GenerateRequest(prompt_text=TEXT[:20000].encode())  # too many tokens


def worker_bad():
    ch = chan()
    stub = pbg.InferenceStub(ch)
    raw_gen = ch.unary_stream("/cemlm.v1.Inference/Generate", request_serializer=None,
                              response_deserializer=None)
    raw_score = ch.unary_unary("/cemlm.v1.Inference/Score", request_serializer=None,
                               response_deserializer=None)
    gens = list(bad_generates())
    while not stop.is_set():
        time.sleep(0.005)
        r = random.random()
        try:
            if r < 0.45:
                run_generate(stub, random.choice(gens), timeout=30)
                continue
            if r < 0.55:
                m = "Score"
                stub.Score(random.choice([
                    pb.ScoreRequest(ids=[1]), pb.ScoreRequest(ids=[1, 5000]),
                    pb.ScoreRequest(text=b"a", recursion_depth=20),
                    pb.ScoreRequest(ids=[5] * 600), pb.ScoreRequest(text=b"\xc3"),
                    pb.ScoreRequest(text=b"y" * 150000)]), timeout=30)
            elif r < 0.65:
                m = "Detokenize"
                stub.Detokenize(pb.DetokenizeRequest(ids=random.choice(
                    [[99999], [-1], [5] * 200000, [1, 2, 3]])), timeout=30)
            elif r < 0.72:
                m = "Generate"
                # not a GenerateRequest: field 1 as a varint where bytes are expected
                for _ in raw_gen(b"\x08\x01\x12\xff", timeout=30):
                    pass
            elif r < 0.78:
                m = "Score"
                raw_score(b"\xff\xff\xff\xff", timeout=30)
            elif r < 0.8:
                # over 4 MiB: refused by gRPC before the service sees it (not in requests_total)
                try:
                    stub.Score(pb.ScoreRequest(text=b"z" * (5 << 20)), timeout=30)
                    with lock:
                        extra["oversize_ok?!"] += 1
                except grpc.RpcError as e:
                    with lock:
                        extra["oversize_" + code_of(e)] += 1
                continue
            elif r < 0.9:
                m = "Tokenize"
                stub.Tokenize(pb.TokenizeRequest(text=text(random.choice([10, 3000])),
                                                 add_bos=random.random() < 0.5), timeout=30)
            elif r < 0.95:
                m = "Detokenize"
                stub.Detokenize(pb.DetokenizeRequest(ids=[random.randrange(4096)
                                                          for _ in range(50)]), timeout=30)
            else:
                m = "GetModelInfo"
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            note(m, "OK")
        except grpc.RpcError as e:
            note(m, code_of(e))


def worker_kill():
    """`cemlm client generate` processes killed with SIGKILL mid-stream."""
    while not stop.is_set():
        args = [CEMLM, "client", "generate", "--addr", ADDR, "--prompt",
                text(200).decode("utf-8", "replace").replace("\0", " "),
                "--max-new-tokens", "300", "--recursion", str(random.randint(1, 8))]
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(random.choice([0.05, 0.2, 0.5, 1.0, 2.0]))
        if p.poll() is None:
            p.kill()
            with lock:
                extra["killed_mid_call"] += 1
        else:
            with lock:
                extra["killer_finished_rc%d" % p.returncode] += 1
        p.wait()


def worker_burst():
    """Bursts that overflow --max-running + --max-waiting (RESOURCE_EXHAUSTED, preemption)."""
    stub = pbg.InferenceStub(chan())
    while not stop.is_set():
        ts = []
        for _ in range(40):
            req = gen_request()
            req.sampling.max_new_tokens = 150
            req.sampling.ignore_eos = True
            req.priority = random.choice([-2, 0, 5])
            ts.append(threading.Thread(target=run_generate, args=(stub, req, 90)))
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        stop.wait(random.uniform(5, 20))


def worker_unread():
    """Batches of streams read once and then left unread (a small HTTP/2 window, so that the
    server's writes stall), then cancelled or read out."""
    ch = chan((("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)))
    stub = pbg.InferenceStub(ch)
    while not stop.is_set():
        calls = []
        for _ in range(random.randint(5, 24)):
            req = gen_request()
            req.sampling.max_new_tokens = random.choice([50, 150, 300])
            req.sampling.ignore_eos = True
            req.logprobs = True
            req.sampling.top_logprobs = 20
            req.prompt_ids[:] = [random.randrange(4, 4096) for _ in range(8)]
            calls.append(stub.Generate(req, timeout=random.choice([30, 60])))
        stop.wait(random.uniform(2, 15))
        for call in calls:
            try:
                if random.random() < 0.5:
                    call.cancel()
                    next(call)
                for _ in call:
                    pass
                note("Generate", "OK")
            except grpc.RpcError as e:
                note("Generate", code_of(e))


def proc_sample(pid):
    status = open("/proc/%d/status" % pid).read()
    field = lambda name: int(re.search(r"^%s:\s+(\d+)" % name, status, re.M).group(1))
    return field("VmRSS"), len(os.listdir("/proc/%d/fd" % pid)), field("Threads")


def scrape(url):
    out = {}
    for ln in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if ln and not ln.startswith("#"):
            name, val = ln.rsplit(" ", 1)
            out[name] = float(val)
    return out


def sample(pid, url, t0, label):
    rss, fds, threads = proc_sample(pid)
    m = scrape(url)
    gauge = lambda name: sum(v for k, v in m.items() if k.startswith("cemlm:" + name + "{"))
    row = {"t": round(time.time() - t0), "label": label, "rss_mb": round(rss / 1024, 1),
           "fds": fds, "threads": threads, "running": gauge("num_requests_running"),
           "waiting": gauge("num_requests_waiting"), "scoring": gauge("num_score_calls_running"),
           "kv": gauge("kv_cache_usage_perc"),
           "unread": gauge("num_unread_streams"), "preempted": gauge("num_preemptions_total"),
           "requests": gauge("requests_total"), "errors": gauge("request_errors_total")}
    print(" ".join("%s=%s" % kv for kv in row.items()), flush=True)
    return row, m


def by_method_code(m):
    out = collections.Counter()
    for k, v in m.items():
        if k.startswith("cemlm:requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', k))
            out[(labels["method"], labels["code"])] += int(v)
    return out


def start_server(args, log_path):
    cmd = [args.cemlm, "serve", "--model", args.model, "--host", "127.0.0.1", "--port", "0",
           "--metrics-port", "0", "--max-running", "16", "--max-waiting", "16",
           "--kv-cache-memory", args.kv_cache_memory]
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True,
                            env=env)
    line = proc.stdout.readline()
    ports = re.search(r"grpc port (\d+), metrics port (\d+)", line)
    # The ports come before the model is loaded: the baseline is taken once it serves.
    serving = False
    for _ in range(1200):
        serving = " info serving " in open(log_path).read()
        if not ports or proc.poll() is not None or serving:
            break
        time.sleep(0.1)
    if not serving:
        proc.kill()
        proc.wait()
        sys.exit("cemlm serve did not start serving within 120 s: " + line +
                 open(log_path).read())
    return proc, int(ports.group(1)), int(ports.group(2))


def load_stubs(out_dir):
    proto_root = os.path.join(ROOT, "proto")
    subprocess.run(["protoc", "--plugin=protoc-gen-grpc_python=" + shutil.which("grpc_python_plugin"),
                    "--proto_path=" + proto_root, "--python_out=" + out_dir,
                    "--grpc_python_out=" + out_dir, "cemlm/v1/inference.proto"], check=True)
    sys.path.insert(0, out_dir)
    return (importlib.import_module("cemlm.v1.inference_pb2"),
            importlib.import_module("cemlm.v1.inference_pb2_grpc"))


def main():
    global grpc, pb, pbg, CEMLM
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cemlm", default=os.path.join(ROOT, "build/cli/cemlm"),
                    help="the cemlm binary (default: build/cli/cemlm in this repository)")
    ap.add_argument("--model", default=os.path.join(ROOT, "models/default"),
                    help="checkpoint directory to serve (default: models/default in this "
                    "repository)")
    ap.add_argument("--minutes", type=float, default=13,
                    help="minutes of traffic before the idle checks (default: 13)")
    ap.add_argument("--sample", type=float, default=60,
                    help="seconds between samples (default: 60)")
    ap.add_argument("--kv-cache-memory", default="8M",
                    help="serve's --kv-cache-memory (default: 8M)")
    ap.add_argument("--out", default=None, help="directory for serve.log (default: a temp dir)")
    args = ap.parse_args()
    CEMLM = args.cemlm
    out = args.out or tempfile.mkdtemp(prefix="cemlm-soak-")
    os.makedirs(out, exist_ok=True)
    import grpc as grpc_module
    grpc = grpc_module
    stubs = tempfile.mkdtemp(prefix="cemlm-soak-stubs-")
    try:
        pb, pbg = load_stubs(stubs)
    finally:
        shutil.rmtree(stubs)
    log_path = os.path.join(out, "serve.log")
    # SIGTERM (a CI runner's, a supervisor's) ends the soak through the finally below, which
    # stops the server too: it was left running, re-parented to init.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("soak: SIGTERM"))
    server, port, mport = start_server(args, log_path)
    try:
        return soak(args, server, port, mport, log_path)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def soak(args, server, port, mport, log_path):
    global ADDR
    ADDR, url = "127.0.0.1:%d" % port, "http://127.0.0.1:%d/metrics" % mport
    print("cemlm serve pid %d, grpc %s, metrics %s, log %s" % (server.pid, ADDR, url, log_path))
    # One call of each kind first: gRPC opens some of its descriptors (pollers) at the first call.
    warm = grpc.insecure_channel(ADDR)
    stub = pbg.InferenceStub(warm)
    list(stub.Generate(pb.GenerateRequest(prompt_ids=[5, 6], sampling=pb.SamplingParams(
        max_new_tokens=2)), timeout=60))
    stub.Score(pb.ScoreRequest(ids=[5, 6, 7]), timeout=60)
    warm.close()
    t0 = time.time()
    base, _ = sample(server.pid, url, t0, "baseline")
    workers = [(worker_stream, 8), (worker_score, 3), (worker_bad, 2), (worker_kill, 2),
               (worker_burst, 1), (worker_unread, 2)]
    died = []  # a worker that raised stopped its share of the load: the run did not soak

    def guarded(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (reported below, with the worker's name)
            died.append("%s: %r" % (fn.__name__, e))
            raise

    threads = [threading.Thread(target=guarded, args=(fn,), daemon=True)
               for fn, k in workers for _ in range(k)]
    for t in threads:
        t.start()
    end, minute = t0 + args.minutes * 60, 0
    while time.time() < end:
        time.sleep(max(0.1, min(args.sample, end - time.time())))
        minute += 1
        sample(server.pid, url, t0, "load-%d" % minute)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    for ch in channels:
        ch.close()
    time.sleep(5)
    idle, m = sample(server.pid, url, t0, "idle")
    problems = ["%s = %s when idle" % (k, idle[k]) for k in ("running", "waiting", "scoring", "kv", "unread")
                if idle[k] != 0]
    if idle["fds"] > base["fds"]:
        problems.append("%d fds when idle, %d at the start" % (idle["fds"], base["fds"]))
    if any(t.is_alive() for t in threads):
        problems.append("a client thread is stuck")
    problems += ["a client thread died, %s" % d for d in died]
    server_counts = by_method_code(m)
    print("%-13s %-19s %8s %8s" % ("method", "code", "client", "server"))
    for key in sorted(set(counts) | set(server_counts)):
        print("%-13s %-19s %8d %8d" % (key[0], key[1], counts[key], server_counts[key]))
    print("client total %d + %d killed clients; server total %d; not in requests_total or of "
          "unknown outcome: %s" % (sum(counts.values()), extra["killed_mid_call"] +
                                   sum(v for k, v in extra.items() if k.startswith("killer_")),
                                   sum(server_counts.values()), dict(extra)))
    server.terminate()
    try:
        if server.wait(timeout=60) != 0:
            problems.append("SIGTERM: exit %d" % server.returncode)
    except subprocess.TimeoutExpired:
        problems.append("SIGTERM: still running 60 s later (killed)")
    bad = [ln for ln in open(log_path) if not re.match(r"\S+ info ", ln)]
    if bad:
        problems.append("%d log lines above info, the first: %s" % (len(bad), bad[0].strip()))
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
