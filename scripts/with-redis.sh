#!/usr/bin/env bash
# Run a command with REDIS_URL pointing at a real redis-server.
# If REDIS_URL is already set it is used as is; otherwise redis-server is installed when
# missing (apt-get; CI machines start bare) and started on a free loopback port for the
# duration of the command.
set -euo pipefail

if [[ -n "${REDIS_URL:-}" ]]; then
  exec "$@"
fi

if ! command -v redis-server >/dev/null 2>&1; then
  echo "with-redis: installing redis-server" >&2
  if [[ $(id -u) -eq 0 ]]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq >/dev/null
  # Install without starting the packaged system service (policy-rc.d 101: do not start).
  guard=""
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    guard=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$guard" >/dev/null
    $SUDO chmod +x "$guard"
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    redis-server >/dev/null
  if [[ -n "$guard" ]]; then $SUDO rm -f "$guard"; fi
fi

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')
dir=$(mktemp -d)
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" \
  --daemonize no --loglevel warning >"$dir/redis.log" 2>&1 &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT

for _ in $(seq 1 100); do
  if redis-cli -p "$port" ping >/dev/null 2>&1; then break; fi
  sleep 0.05
done
redis-cli -p "$port" ping >/dev/null || { echo "with-redis: redis-server did not start" >&2; cat "$dir/redis.log" >&2; exit 1; }

export REDIS_URL="redis://127.0.0.1:$port/0"
echo "with-redis: redis-server on $REDIS_URL" >&2
"$@"
