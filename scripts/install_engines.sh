#!/usr/bin/env bash
# Installs the real launchers that tests/engines.py starts: SLURM (with munge), OpenMPI and MPICH.
# Debian or Ubuntu, as root. Does nothing when they are installed already; without root or apt-get it only says
# so (the engine tests then skip, or fail where CI=true).
set -euo pipefail
packages=(slurm-wlm munge openmpi-bin mpich)
if dpkg -s "${packages[@]}" >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "install_engines.sh: not root or no apt-get; not installing ${packages[*]}" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
