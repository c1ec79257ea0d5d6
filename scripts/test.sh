#!/usr/bin/env bash
# The project's checks, in the order a reviewer cares about: lint, format, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
mypy
python -m pytest -q "$@"
