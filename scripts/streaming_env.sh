#!/usr/bin/env bash
# A separate virtual environment with mosaicml-streaming, for the optional test of real MDS shards through the
# Trainer (tests/trainer/test_real_streaming.py). It cannot live in the main one: mosaicml-streaming pins
# numpy<2.2 and transformers<5, and pulls a CUDA torch unless torch and torchvision are pinned.
# Usage: bash scripts/streaming_env.sh [VENV_DIR]   (default: .venv-streaming in the repository; about 3 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-streaming}"
python -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "torch==2.13.0" "torchvision==0.28.*" mosaicml-streaming pytest
"$venv/bin/pip" install -q -e .
echo "$venv/bin/python"
