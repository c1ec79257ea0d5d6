#!/usr/bin/env bash
# The GPU check, one command for a machine with a CUDA GPU: the real-GPU tests (tests/gpu, marker `cuda`), the
# CUDA tests with the runtime faked (tests/accelerators/test_cuda.py), the examples that take --accelerator on cuda, and
# the GPU benchmark (benchmarks/gpu.py). Writes one report with each part's command, exit code, time and output tail.
#
#   bash scripts/gpu_check.sh [REPORT]      # default REPORT: gpu_report.md at the repository root
#
# Without a CUDA GPU it runs only what needs none (the GPU tests are collected and skip, the faked-CUDA tests,
# the benchmark's --cpu-smoke run) and says so. Runs from the source tree (PYTHONPATH=<repository root>), from
# any directory; $PYTHON picks the interpreter (default: python); $GPU_CHECK_BENCH_ARGS adds arguments to the
# benchmark (e.g. "--no-compile" to save minutes). Exits 1 if a part that ran failed, else 0.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPORT="${1:-$ROOT/gpu_report.md}"
case "$REPORT" in /*) ;; *) REPORT="$PWD/$REPORT" ;; esac
PYTHON="${PYTHON:-python}"
TAIL_LINES="${GPU_CHECK_TAIL_LINES:-60}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" || exit 1

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
PARTS="$WORK/parts.md"   # each part's section, in order
SUMMARY="$WORK/summary.md"  # one table row per part
: >"$PARTS"
: >"$SUMMARY"
failed=0
number=0

# run_part TITLE DIRECTORY COMMAND...: run COMMAND in DIRECTORY, show its output, record it in the report.
run_part() {
  local title="$1" directory="$2"
  shift 2
  number=$((number + 1))
  local log="$WORK/part-$number.log" started=$SECONDS
  echo "== [$number] $title: $*"
  (cd "$directory" && "$@") 2>&1 | tee "$log"
  local status=${PIPESTATUS[0]}
  local seconds=$((SECONDS - started))
  [ "$status" -eq 0 ] || failed=1
  echo "== [$number] $title: exit code $status ($seconds s)"
  echo "| $number | $title | $status | $seconds |" >>"$SUMMARY"
  {
    echo "## $number. $title"
    echo
    echo "- command: \`$*\` (in \`$directory\`)"
    echo "- exit code: $status"
    echo "- seconds: $seconds"
    echo
    echo "Last $TAIL_LINES lines of output:"
    echo
    echo '```'
    tail -n "$TAIL_LINES" "$log"
    echo '```'
    echo
  } >>"$PARTS"
}

# skip_part TITLE REASON: record a part that did not run, and why.
skip_part() {
  number=$((number + 1))
  echo "== [$number] $1: skipped: $2"
  echo "| $number | $1 | skipped | - |" >>"$SUMMARY"
  printf '## %s. %s\n\n- skipped: %s\n\n' "$number" "$1" "$2" >>"$PARTS"
}

if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  has_gpu=1
else
  has_gpu=0
fi
device="$("$PYTHON" -c 'import torch
print(", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) or "no CUDA GPU")' 2>&1)"
versions="$("$PYTHON" -c 'import sys, torch
cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
print(f"python {sys.version.split()[0]}, torch {torch.__version__} ({cuda})")' 2>&1)"
commit="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ -n "$(git -C "$ROOT" status --porcelain 2>/dev/null)" ]; then commit="$commit (with uncommitted changes)"; fi

if [ "$has_gpu" -eq 1 ]; then
  run_part "real-GPU tests (tests/gpu)" "$ROOT" "$PYTHON" -m pytest -q -m cuda tests/gpu
  run_part "faked-CUDA tests (tests/accelerators/test_cuda.py)" "$ROOT" "$PYTHON" -m pytest -q tests/accelerators/test_cuda.py
  for example in train_fabric ddp_train fsdp_train trainer_train deepspeed_train; do
    script="$ROOT/examples/$example.py"
    if [ ! -f "$script" ]; then
      skip_part "example $example.py on cuda" "no such file"
    elif [ "$example" = deepspeed_train ] && ! "$PYTHON" -c 'import deepspeed' >/dev/null 2>&1; then
      skip_part "example $example.py on cuda" "deepspeed is not importable"
    elif ! grep -q -- '"--accelerator"' "$script"; then
      skip_part "example $example.py on cuda" "it takes no --accelerator option (its accelerator is fixed in the code)"
    else
      mkdir -p "$WORK/$example"  # the examples write their checkpoints and runs into the working directory
      run_part "example $example.py on cuda" "$WORK/$example" "$PYTHON" "$script" --accelerator cuda
      if [ "$example" = train_fabric ]; then
        run_part "example $example.py on cuda, bf16-mixed" "$WORK/$example" \
          "$PYTHON" "$script" --accelerator cuda --precision bf16-mixed
      fi
    fi
  done
  read -r -a bench_args <<<"${GPU_CHECK_BENCH_ARGS:-}"
  run_part "GPU benchmark (benchmarks/gpu.py)" "$ROOT" "$PYTHON" benchmarks/gpu.py ${bench_args[@]+"${bench_args[@]}"}
else
  echo "no CUDA GPU here: ran only the CPU-runnable parts"
  run_part "real-GPU tests (tests/gpu), collected: they skip without a GPU" "$ROOT" "$PYTHON" -m pytest -q tests/gpu
  run_part "faked-CUDA tests (tests/accelerators/test_cuda.py)" "$ROOT" "$PYTHON" -m pytest -q tests/accelerators/test_cuda.py
  skip_part "examples on cuda" "no CUDA GPU here"
  run_part "GPU benchmark, CPU smoke run (benchmarks/gpu.py --cpu-smoke)" "$ROOT" "$PYTHON" benchmarks/gpu.py --cpu-smoke
fi

{
  echo "# GPU check"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "- device: $device"
  echo "- $versions"
  echo "- commit: $commit"
  if [ "$has_gpu" -eq 0 ]; then
    echo "- no CUDA GPU here: ran only the CPU-runnable parts"
  fi
  echo "- result: $([ "$failed" -eq 0 ] && echo "every part that ran passed" || echo "FAILED (see the parts below)")"
  echo
  echo "| part | what | exit code | seconds |"
  echo "|---:|---|---|---:|"
  cat "$SUMMARY"
  echo
  cat "$PARTS"
} >"$REPORT"

echo "report: $REPORT"
if [ "$has_gpu" -eq 0 ]; then
  echo "no CUDA GPU here: ran only the CPU-runnable parts"
fi
exit "$failed"
