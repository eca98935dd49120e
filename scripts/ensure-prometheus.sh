#!/usr/bin/env bash
# Make sure `promtool` and `prometheus` are on PATH: Debian's prometheus package ships both
# (about 100 MB installed, under a minute). CI machines start bare, so this installs with
# apt-get when either is missing; it never starts the packaged daemon.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  exit 0
fi

echo "ensure-prometheus: installing prometheus (promtool)" >&2
if [[ $(id -u) -eq 0 ]]; then SUDO=""; else SUDO="sudo"; fi
# No service is started by the package's maintainer scripts (policy-rc.d 101 = "action
# forbidden"); tests start their own Prometheus on loopback.
policy=/usr/sbin/policy-rc.d
created_policy=""
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
  $SUDO chmod +x "$policy"
  created_policy=1
fi
cleanup() { if [[ -n $created_policy ]]; then $SUDO rm -f "$policy"; fi; }
trap cleanup EXIT

$SUDO apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  prometheus >/dev/null
command -v promtool >/dev/null && command -v prometheus >/dev/null
promtool --version 2>&1 | head -1 >&2
