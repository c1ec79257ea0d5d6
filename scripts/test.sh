#!/usr/bin/env bash
# The project's checks, in the order a reviewer cares about: lint, format, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
mypy
python -m pytest --durations=15 "$@"  # each file named as it runs; the slowest tests at the end
if [ "$#" -eq 0 ]; then
  # The algorithm tests (conv, pooling and normalisation kernels) once more on the AVX2 kernel family of ATen
  # and oneDNN, so a machine with AVX-512 also catches what breaks only on AVX2 CPUs (as ChannelsLast did).
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m pytest -q tests/trainer/algorithms
fi
