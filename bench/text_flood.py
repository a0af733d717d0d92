#!/usr/bin/python3
"""Flood of Tokenize calls against `cemlm serve`: its memory and threads while many arrive at once.

Starts `cemlm serve` on the given model, then sends --calls Tokenize calls of --bytes of text each,
all at once, spread over --channels connections, and waits for every answer. Prints a table: the
time the flood took, the calls answered by status, and the server's resident memory and thread
count before, at their peak (sampled every 10 ms) and after. The server tokenizes at most
--threads texts at once (docs/API.md), the other calls waiting their turn; their threads and
request bodies are what the peak holds. A benchmark to read, not a test: docs/BENCHMARKS.md.

    /usr/bin/python3 bench/text_flood.py --model models/default --calls 2000 --bytes 30000

Needs python3-grpcio (the calls are sent as raw bytes: no generated stubs).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tokenize_request(text):
    """TokenizeRequest{text = 1 (bytes)} as protobuf wire bytes."""
    header, n = bytearray([1 << 3 | 2]), len(text)
    while True:
        header.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            break
    return bytes(header) + text


def proc_status(pid):
    """(threads, resident MB) of process pid."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cemlm", default=os.path.join(ROOT, "build/cli/cemlm"),
                    help="the cemlm binary (default: build/cli/cemlm in this repository)")
    ap.add_argument("--model", default=os.path.join(ROOT, "models/default"),
                    help="checkpoint directory to serve (default: models/default in this "
                         "repository)")
    ap.add_argument("--threads", type=int, default=0,
                    help="serve's --threads, also the texts it tokenizes at once (default: 0, "
                         "the CPUs)")
    ap.add_argument("--calls", type=int, default=2000, help="Tokenize calls (default: 2000)")
    ap.add_argument("--bytes", type=int, default=30000,
                    help="bytes of text in each call (default: 30000)")
    ap.add_argument("--channels", type=int, default=8,
                    help="connections the calls are spread over (default: 8)")
    args = ap.parse_args()
    if args.calls < 1 or args.bytes < 1 or args.channels < 1:
        ap.error("--calls, --bytes and --channels must be at least 1")
    try:
        import grpc
    except ImportError:
        sys.exit("needs python3-grpcio (apt-get install python3-grpcio)")
    words = open("/usr/share/games/fortunes/fortunes", encoding="utf-8",
                 errors="replace").read().encode()
    text = (words * (args.bytes // len(words) + 1))[:args.bytes]
    body = tokenize_request(text)

    serve = subprocess.Popen(
        [args.cemlm, "serve", "--model", args.model, "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--threads", str(args.threads), "--log-level", "warn"],
        stdout=subprocess.PIPE, text=True)
    try:
        port = int(re.search(r"grpc port (\d+)", serve.stdout.readline()).group(1))
        chans = [grpc.insecure_channel(f"127.0.0.1:{port}",
                                       options=[("grpc.use_local_subchannel_pool", 1)])
                 for _ in range(args.channels)]
        grpc.channel_ready_future(chans[0]).result(timeout=120)
        info = chans[0].unary_unary("/cemlm.v1.Inference/GetModelInfo")
        for _ in range(600):  # health says SERVING once loaded; an answer is simpler here
            if serve.poll() is not None:
                sys.exit(f"cemlm serve exited with {serve.returncode} before it served")
            try:
                info(b"", timeout=10)
                break
            except grpc.RpcError:
                time.sleep(0.1)
        else:
            sys.exit("cemlm serve did not answer GetModelInfo within a minute")
        before = proc_status(serve.pid)
        peak = list(before)
        done = threading.Event()

        def sample():
            while not done.is_set():
                now = proc_status(serve.pid)
                peak[0], peak[1] = max(peak[0], now[0]), max(peak[1], now[1])
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        calls = [c.unary_unary("/cemlm.v1.Inference/Tokenize") for c in chans]
        start = time.monotonic()
        futures = [calls[i % len(calls)].future(body) for i in range(args.calls)]
        codes = collections.Counter()
        for f in futures:
            try:
                f.result()
                codes["OK"] += 1
            except grpc.RpcError as e:
                codes[e.code().name] += 1
        seconds = time.monotonic() - start
        done.set()
        sampler.join()
        time.sleep(1)
        after = proc_status(serve.pid)
        for c in chans:
            c.close()
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    print(f"{args.calls} Tokenize calls of {args.bytes} bytes at once over {args.channels} "
          f"connections, serve --threads {args.threads}")
    print(f"{'seconds':>8} {'calls/s':>8}  answers")
    print(f"{seconds:8.1f} {args.calls / seconds:8.0f}  "
          + ", ".join(f"{code} {n}" for code, n in sorted(codes.items())))
    print(f"{'':>8} {'before':>8} {'peak':>8} {'after':>8}")
    print(f"{'RSS MB':>8} {before[1]:8.0f} {peak[1]:8.0f} {after[1]:8.0f}")
    print(f"{'threads':>8} {before[0]:8d} {peak[0]:8d} {after[0]:8d}")


if __name__ == "__main__":
    main()
