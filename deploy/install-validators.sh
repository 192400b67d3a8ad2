#!/usr/bin/env bash
# Installs the real validators the deployment tests run: docker-compose (Debian's compose-file
# parser, `docker-compose config` needs no engine) and systemd-analyze (from Debian's systemd).
set -euo pipefail
need=()
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-validators: missing ${need[*]}; install them (Debian: apt-get install ${need[*]}) to run the deployment tests" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || true
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
