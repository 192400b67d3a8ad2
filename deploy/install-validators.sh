#!/usr/bin/env bash
# Installs the real validators the deployment tests (tests/test_deploy.py) run: docker-compose
# (Debian's compose-file parser, `docker-compose config` needs no engine) and systemd-analyze
# (from Debian's systemd). It says what it installs and why; where it cannot install (not root,
# no apt-get, apt fails) it prints the command to run and exits 0: those tests then skip with the
# same hint (under CI they fail instead).
set -uo pipefail
need=()
why=()
if ! command -v docker-compose >/dev/null 2>&1; then
  need+=(docker-compose)
  why+=("docker-compose: its parser checks docker-compose.yml and deploy/compose/*.yml")
fi
if ! command -v systemd-analyze >/dev/null 2>&1; then
  need+=(systemd)
  why+=("systemd: systemd-analyze verifies the units in deploy/systemd/")
fi
[ ${#need[@]} -eq 0 ] && exit 0
hint="apt-get install --no-install-recommends ${need[*]}"
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-validators: ${need[*]} missing and not installing them (needs root and apt-get);" \
       "the deployment tests will skip. To run them: $hint" >&2
  exit 0
fi
echo "install-validators: installing Debian packages for the deployment tests (with their dependencies):"
for line in "${why[@]}"; do
  echo "  $line"
done
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
apt-get update -qq >"$log" 2>&1 || echo "install-validators: apt-get update failed; trying the cached package lists" >&2
if ! apt-get install -y -qq --no-install-recommends "${need[@]}" >>"$log" 2>&1; then
  tail -n 20 "$log" >&2
  echo "install-validators: apt-get install failed (above); the deployment tests will skip. To run them: $hint" >&2
  exit 0
fi
echo "install-validators: installed ${need[*]}"
