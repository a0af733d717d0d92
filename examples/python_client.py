#!/usr/bin/python3
"""A small Python client of `cemlm serve`: model info, a streamed generation and a score.

Needs Debian's python3-grpcio and python3-protobuf. The stubs are generated at run time from
proto/cemlm/v1/inference.proto into a temporary directory (removed on exit), with protoc and
grpc_python_plugin (Debian: protobuf-compiler, protobuf-compiler-grpc), or with grpc_tools when
that is installed.

    /usr/bin/python3 examples/python_client.py --addr localhost:50051 --prompt "Hello" --recursion 2
"""
import argparse
import importlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

PROTO_ROOT = pathlib.Path(__file__).resolve().parent.parent / "proto"
PROTO = "cemlm/v1/inference.proto"


def generate_stubs(out_dir):
    """Writes cemlm/v1/inference_pb2.py and inference_pb2_grpc.py under out_dir."""
    args = [f"--proto_path={PROTO_ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
            PROTO]
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    if protoc and plugin:
        cmd = [protoc, f"--plugin=protoc-gen-grpc_python={plugin}"] + args
        subprocess.run(cmd, check=True)
        return
    try:
        from grpc_tools import protoc as grpc_protoc
    except ImportError:
        sys.exit("need protoc + grpc_python_plugin (apt install protobuf-compiler "
                 "protobuf-compiler-grpc) or grpc_tools to generate the stubs")
    if grpc_protoc.main(["protoc"] + args) != 0:
        sys.exit("grpc_tools.protoc failed")


def load_stubs(out_dir):
    generate_stubs(out_dir)
    sys.path.insert(0, out_dir)
    return (importlib.import_module("cemlm.v1.inference_pb2"),
            importlib.import_module("cemlm.v1.inference_pb2_grpc"))


def channel(grpc, args):
    if not args.tls_ca:
        return grpc.insecure_channel(args.addr)
    try:
        with open(args.tls_ca, "rb") as f:
            pem = f.read()
    except OSError as e:
        sys.exit(f"--tls-ca: cannot read '{args.tls_ca}': {e.strerror}")
    return grpc.secure_channel(args.addr, grpc.ssl_channel_credentials(root_certificates=pem))


def run(args, grpc, pb, pb_grpc):
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
    stub = pb_grpc.InferenceStub(channel(grpc, args))

    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=args.timeout)
    print(f"model {info.model_name}: {info.variant}, {info.parameters} parameters, "
          f"T default {info.default_recursion_depth} max {info.max_recursion_depth}")

    # The command line's bytes as given (os.fsencode undoes Python's surrogate escapes): a prompt
    # that is not UTF-8 gets the server's error naming the byte, not a UnicodeEncodeError here.
    prompt = os.fsencode(args.prompt)
    request = pb.GenerateRequest(
        prompt_text=prompt, recursion_depth=args.recursion, logprobs=True,
        sampling=pb.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8, seed=1))
    last = None
    for msg in stub.Generate(request, metadata=metadata, timeout=args.timeout):
        print(msg.text, end="", flush=True)
        last = msg
    print()
    print(f"finish {pb.FinishReason.Name(last.finish_reason)}, "
          f"{last.usage.generated_tokens} tokens, {last.usage.recursion_steps} recursion steps, "
          f"engine {last.timing.e2e_seconds * 1e3:.1f} ms")

    score = stub.Score(pb.ScoreRequest(text=prompt, recursion_depth=args.recursion),
                       metadata=metadata, timeout=args.timeout)
    print(f"score of the prompt: nll {score.nll:.4f}, perplexity {score.perplexity:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--addr", default="localhost:50051",
                    help="server address HOST:PORT (default: localhost:50051)")
    ap.add_argument("--prompt", default="The answer is",
                    help="prompt text (default: 'The answer is')")
    ap.add_argument("--recursion", type=int, default=0,
                    help="recursion depth T; 0 = model default (default: 0)")
    ap.add_argument("--max-new-tokens", type=int, default=32,
                    help="tokens to generate at most (default: 32)")
    ap.add_argument("--api-key",
                    help="sent as 'authorization: Bearer KEY' (default: $CEMLM_API_KEY)")
    ap.add_argument("--tls-ca", help="PEM CA certificate: connect with TLS (else plaintext)")
    ap.add_argument("--timeout", type=float, default=30.0, help="deadline per call, seconds (default: 30)")
    args = ap.parse_args()
    source = "--api-key"
    if args.api_key is None:
        args.api_key, source = os.environ.get("CEMLM_API_KEY"), "CEMLM_API_KEY"
    # gRPC refuses header values outside printable ASCII (a key read with its line end) with a
    # traceback; say which.
    if args.api_key and any(not 0x20 <= ord(c) <= 0x7E for c in args.api_key):
        sys.exit(f"{source} holds a character other than printable ASCII (a line end read from a "
                 "file?)")

    try:
        import grpc  # imported late so that --help works without python3-grpcio
    except ImportError:
        sys.exit("needs gRPC for Python: apt install python3-grpcio python3-protobuf")

    with tempfile.TemporaryDirectory(prefix="cemlm_stubs_") as stubs:
        pb, pb_grpc = load_stubs(stubs)
        try:
            run(args, grpc, pb, pb_grpc)
        except grpc.RpcError as e:
            sys.exit(f"{args.addr}: {e.code().name}: {e.details()}")


if __name__ == "__main__":
    main()
