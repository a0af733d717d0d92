#!/usr/bin/env bash
# The main job on a fresh machine: install what is missing, build, train the small default model
# on the fortunes corpus if models/default is absent (≤ 10 min on 2 cores), start the gRPC server,
# send a streaming request at two recursion depths, show per-T perplexity, and stop the server.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."  # through a symlink too
CEMLM_SETUP_TARGET=cemlm scripts/setup.sh  # the program alone: the tests build with scripts/test.sh
CEMLM=build/cli/cemlm
MODEL=${CEMLM_MODEL_DIR:-models/default}
while [[ "$MODEL" == ?*/ ]]; do MODEL=${MODEL%/}; done  # its saves' leftovers: "$MODEL.tmp-*"
PORT=${CEMLM_PORT:-50051}
METRICS_PORT=${CEMLM_METRICS_PORT:-9400}

shopt -s nullglob
aside=("$MODEL".tmp-*.old)  # the name matched literally, only the suffix as a pattern
shopt -u nullglob
if [ ! -e "$MODEL" ] && [ ${#aside[@]} -gt 0 ]; then
  # A save interrupted on a filesystem that cannot swap directories left the run moved aside.
  echo "== $MODEL was moved aside by an interrupted save: putting it back, finishing its training"
  "$CEMLM" train --out "$MODEL" --resume
elif [ ! -f "$MODEL/config.json" ]; then
  echo "== training the default model into $MODEL (fortunes corpus)"
  "$CEMLM" train --out "$MODEL"
elif [ -f "$MODEL/trainer_state.json" ]; then
  # A run stopped early (Ctrl-C saves a resumable checkpoint) goes on before it is served.
  done_steps=$(grep -o '"step": [0-9]*' "$MODEL/trainer_state.json" | grep -o '[0-9]*$' || true)
  all_steps=$(grep -o '"steps": [0-9]*' "$MODEL/trainer_state.json" | grep -o '[0-9]*$' || true)
  if [ -n "$done_steps" ] && [ -n "$all_steps" ] && [ "$done_steps" -lt "$all_steps" ]; then
    echo "== $MODEL stopped at step $done_steps of $all_steps: finishing its training"
    "$CEMLM" train --out "$MODEL" --resume
  fi
fi
"$CEMLM" inspect "$MODEL"

echo "== starting the server on 127.0.0.1:$PORT (metrics on :$METRICS_PORT)"
"$CEMLM" serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --metrics-port "$METRICS_PORT" \
  > server.log 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
# Up once it has said it listens (so a server already on the port cannot answer for it) and
# reports SERVING (the model is loaded).
serving=0
for _ in $(seq 1 240); do
  kill -0 $SERVER 2>/dev/null || {
    cat server.log
    echo "quickstart: the server ended (a port in use? CEMLM_PORT and CEMLM_METRICS_PORT choose others)"
    exit 1
  }
  if grep -q '^cemlm serve: grpc port' server.log &&
    "$CEMLM" client health --addr "127.0.0.1:$PORT" > /dev/null 2>&1; then
    serving=1
    break
  fi
  sleep 0.5
done
if [ "$serving" != 1 ]; then
  cat server.log
  echo "the server did not report SERVING within 120 s (its log is above)" >&2
  exit 1
fi

PROMPT="A fool and his money"
for T in 1 4; do
  echo "== generate, recursion depth T=$T"
  "$CEMLM" client generate --addr "127.0.0.1:$PORT" --prompt "$PROMPT" --recursion "$T" \
    --max-new-tokens 40 --temperature 0.7 --seed 1
  echo
done
echo "== perplexity of a held-out-style sentence at T = 1, 2, 4"
for T in 1 2 4; do
  printf 'T=%s ' "$T"
  "$CEMLM" client score --addr "127.0.0.1:$PORT" --text "The best way to predict the future is to invent it." \
    --recursion "$T" --json
done
echo "== a few metrics"
curl -s "http://127.0.0.1:$METRICS_PORT/metrics" | grep -E '^cemlm:(generation_tokens_total|request_success_total)' || true
