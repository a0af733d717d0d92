#!/usr/bin/env bash
# deploy/entrypoint.sh — starts `cemlm serve` with flags taken from CEMLM_* environment variables,
# and runs the gRPC health check (`entrypoint.sh health`) for Docker's HEALTHCHECK. Works outside
# Docker too: CEMLM_BIN names the program. The variable table is documented in deploy/README.md;
# tests/deploy/deploy_checks.py (its `entrypoint` check) keeps the two in step.
set -eu

# Each line: environment variable, `cemlm serve` flag. Unset or empty leaves the server's default.
readonly FLAG_TABLE='
CEMLM_MODEL             --model
CEMLM_HOST              --host
CEMLM_PORT              --port
CEMLM_METRICS_PORT      --metrics-port
CEMLM_METRICS_HOST      --metrics-host
CEMLM_DEVICE            --device
CEMLM_KV_CACHE_MEMORY   --kv-cache-memory
CEMLM_KV_CACHE_DTYPE    --kv-cache-dtype
CEMLM_MAX_BATCH_TOKENS  --max-batch-tokens
CEMLM_MAX_RUNNING       --max-running
CEMLM_MAX_WAITING       --max-waiting
CEMLM_GRPC_MEMORY       --grpc-memory
CEMLM_API_KEY_FILE      --api-key-file
CEMLM_API_KEY_RELOAD_INTERVAL --api-key-reload-interval
CEMLM_MAX_PRIORITY      --max-priority
CEMLM_PREFIX_CACHE_SCOPE --prefix-cache-scope
CEMLM_TLS_CERT          --tls-cert
CEMLM_TLS_KEY           --tls-key
CEMLM_TLS_RELOAD_INTERVAL --tls-reload-interval
CEMLM_SHUTDOWN_TIMEOUT  --shutdown-timeout
CEMLM_MAX_CONNECTION_AGE --max-connection-age
CEMLM_MAX_CONNECTION_AGE_GRACE --max-connection-age-grace
CEMLM_KEEPALIVE_TIME    --keepalive-time
CEMLM_KEEPALIVE_TIMEOUT --keepalive-timeout
CEMLM_UNREAD_TIMEOUT    --unread-timeout
CEMLM_THREADS           --threads
CEMLM_ENGINE_NICE       --engine-nice
CEMLM_LOG_LEVEL         --log-level
CEMLM_MODEL_NAME        --model-name
'
readonly DEFAULT_PORT=50051  # the server's own default, needed to find it for the health check

usage() {
  cat <<'EOF'
usage: entrypoint.sh [serve] [extra serve flags...]   run `cemlm serve` configured from CEMLM_*
       entrypoint.sh health                           exit 0 when the server reports SERVING
       entrypoint.sh COMMAND [args...]                run `cemlm COMMAND args...` (init, score, ...)
Also read: CEMLM_BIN (program, default `cemlm` on PATH), CEMLM_EXTRA_ARGS (more serve flags,
split on spaces), CEMLM_HEALTH_ADDR (default 127.0.0.1:$CEMLM_PORT, or $CEMLM_HOST:$CEMLM_PORT
when CEMLM_HOST is one address), CEMLM_HEALTH_ARGS.
EOF
}

require_bin() {
  if ! command -v "$CEMLM_BIN" >/dev/null 2>&1; then
    echo "entrypoint.sh: CEMLM_BIN='$CEMLM_BIN' is not an executable program;" \
         "set CEMLM_BIN to the path of cemlm" >&2
    exit 127
  fi
}

serve() {
  local args=() var flag
  while read -r var flag; do
    [ -n "$var" ] || continue
    if [ -n "${!var:-}" ]; then args+=("$flag" "${!var}"); fi
  done <<<"$FLAG_TABLE"
  # Word splitting is the point here: CEMLM_EXTRA_ARGS holds several flags.
  # shellcheck disable=SC2206
  local extra=(${CEMLM_EXTRA_ARGS:-}) a
  # The health check (another process) finds the server through CEMLM_PORT and CEMLM_HOST: a port
  # or address given as a flag would leave it probing the wrong one for good.
  for a in "${extra[@]}" "$@"; do
    case "$a" in
      --port | --port=*)
        echo "entrypoint.sh: set the port with CEMLM_PORT, not --port (the health check reads" \
             "CEMLM_PORT)" >&2
        exit 2 ;;
      --host | --host=*)
        echo "entrypoint.sh: set the address with CEMLM_HOST, not --host (the health check" \
             "reads CEMLM_HOST)" >&2
        exit 2 ;;
    esac
  done
  args+=("${extra[@]}")
  # exec: the server becomes PID 1 in the container and receives SIGTERM itself, to drain.
  exec "$CEMLM_BIN" serve "${args[@]}" "$@"
}

# A server bound to every interface is reached on loopback; one bound to a single address there
# (an IPv6 literal in brackets: [::1]:50051).
health_addr() {
  local host="${CEMLM_HOST:-0.0.0.0}"
  case "$host" in
    0.0.0.0 | :: | "[::]") host=127.0.0.1 ;;
    \[*) ;;
    *:*) host="[$host]" ;;
  esac
  echo "${host}:${CEMLM_PORT:-$DEFAULT_PORT}"
}

health() {
  # shellcheck disable=SC2206
  local extra=(${CEMLM_HEALTH_ARGS:-})
  exec "$CEMLM_BIN" client health --addr "${CEMLM_HEALTH_ADDR:-$(health_addr)}" "${extra[@]}"
}

CEMLM_BIN="${CEMLM_BIN:-cemlm}"
case "${1:-serve}" in
  -h | --help | help) usage ;;
  serve) require_bin; shift $(($# > 0 ? 1 : 0)); serve "$@" ;;
  -*) require_bin; serve "$@" ;;
  health) require_bin; health ;;
  *) require_bin; exec "$CEMLM_BIN" "$@" ;;
esac
