#!/usr/bin/env bash
# The project's checks, in the order a reviewer cares about: lint, format, types, tests.
#
#   bash scripts/test.sh                 # lint, types, the suite (every test not marked end_to_end), the AVX2 pass
#   bash scripts/test.sh --end-to-end    # only the tests marked end_to_end: real client programs and engines
#   bash scripts/test.sh tests/x.py ...  # lint, types, then pytest with these arguments (no AVX2 pass)
#
# CI (.ci/run) runs the first two. Each pytest run names each file as it runs it and lists the slowest tests and
# files at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--end-to-end" ]; then
  shift
  exec python -m pytest --durations=15 -m end_to_end "$@"
fi
ruff check .
ruff format --check .
mypy
if [ "$#" -gt 0 ]; then
  exec python -m pytest --durations=15 "$@"
fi
python -m pytest --durations=15 -m "not end_to_end"
# The algorithm tests (conv, pooling and normalisation kernels) once more on the AVX2 kernel family of ATen
# and oneDNN, so a machine with AVX-512 also catches what breaks only on AVX2 CPUs (as ChannelsLast did). On a CPU
# whose best kernels are AVX2 already, the suite above ran them: the second pass would repeat it (2.4 minutes).
capability="$(python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')"
if [ "$capability" = "AVX2" ]; then
  echo "The suite ran on ATen's AVX2 kernels already (this CPU's best): no second AVX2 pass of tests/trainer/algorithms."
else
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m pytest -q tests/trainer/algorithms
fi
