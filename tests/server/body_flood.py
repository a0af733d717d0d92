#!/usr/bin/env python3
"""Slow-body flood against `cemlm serve` (used by server_test's ServerSecurity tests).

Opens one HTTP/2 connection (TLS when a 5th argument `tls` is given, the certificate not
checked) and STREAMS Generate calls on it, without an API key. Each declares a
gRPC message of 4,000,000 bytes (under the server's 4 MiB limit) and sends all of it but the last
byte, as fast as the server's flow control lets it, so that gRPC holds the bodies waiting for the
rest. Prints one JSON line: bytes sent, streams the server reset (and with which HTTP/2 codes),
whether the connection was closed, and the server's resident memory before and at most during the
flood (from /proc/PID/status), and the grpc-status codes of the calls the server answered.

usage: body_flood.py PORT SERVER_PID [STREAMS] [SECONDS] [tls]
(it stops early once every stream was reset, or after 2 s in which nothing moved)
"""
import json
import select
import socket
import ssl
import struct
import sys
import time

import h2.config
import h2.connection
import h2.events
import h2.exceptions

BODY = 4_000_000
CHUNK = bytes(range(256)) * 64  # 16 KiB of data that does not compress or dedupe


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main():
    port, pid = int(sys.argv[1]), int(sys.argv[2])
    streams = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 30
    tls = len(sys.argv) > 5 and sys.argv[5] == "tls"
    out = {"sent": 0, "resets": 0, "codes": [], "grpc_status": {}, "closed": False,
           "rss_before_kb": rss_kb(pid)}
    out["rss_peak_kb"] = out["rss_before_kb"]
    sock = socket.create_connection(("127.0.0.1", port))
    if tls:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.set_alpn_protocols(["h2"])
        sock = context.wrap_socket(sock, server_hostname="localhost")
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    left = {}

    last_progress = [time.monotonic()]

    def pump(timeout):
        """Reads what the server sent within `timeout`; False once the connection is gone."""
        ready, _, _ = select.select([sock], [], [], timeout)
        if ready:
            last_progress[0] = time.monotonic()
            data = sock.recv(1 << 20)
            if not data:
                return False
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.StreamReset):
                    out["resets"] += 1
                    code = int(event.error_code)
                    if code not in out["codes"]:
                        out["codes"].append(code)
                    left.pop(event.stream_id, None)
                elif isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    for name, value in event.headers:
                        if name == b"grpc-status":
                            key = value.decode()
                            out["grpc_status"][key] = out["grpc_status"].get(key, 0) + 1
                elif isinstance(event, h2.events.StreamEnded):
                    left.pop(event.stream_id, None)
                elif isinstance(event, h2.events.ConnectionTerminated):
                    return False
        sock.sendall(conn.data_to_send())
        out["rss_peak_kb"] = max(out["rss_peak_kb"], rss_kb(pid))
        return True

    alive = True
    for _ in range(5):  # the server's SETTINGS (its stream limit) first
        alive = alive and pump(0.05)
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", "cemlm"),
               (":path", "/cemlm.v1.Inference/Generate"), ("content-type", "application/grpc"),
               ("te", "trailers")]
    for _ in range(streams):
        if conn.open_outbound_streams >= conn.remote_settings.max_concurrent_streams:
            break
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, headers)
        conn.send_data(sid, b"\x00" + struct.pack(">I", BODY))
        left[sid] = BODY - 1
    sock.sendall(conn.data_to_send())
    deadline = time.monotonic() + seconds
    while alive and time.monotonic() < deadline:
        for sid in list(left):
            try:
                while left.get(sid, 0) > 0:
                    n = min(conn.local_flow_control_window(sid), len(CHUNK), left[sid])
                    if n <= 0:
                        break
                    conn.send_data(sid, CHUNK[:n])
                    left[sid] -= n
                    out["sent"] += n
                    last_progress[0] = time.monotonic()
            except h2.exceptions.StreamClosedError:
                left.pop(sid, None)
        sock.sendall(conn.data_to_send())
        alive = pump(0.05)
        if not left or time.monotonic() - last_progress[0] > 2:
            break  # every stream ended or was reset, or the server holds the rest for good
    out["closed"] = not alive
    out["rss_peak_kb"] = max(out["rss_peak_kb"], rss_kb(pid))
    sock.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
