#!/usr/bin/env bash
# The prepared GPU check of issue 48 (benchmarks/accelerator.py at the real
# shapes), for a session that is lent a GPU: run from the repository root,
#
#     OUT=/some/dir bash benchmarks/gpu_check.sh
#
# It installs the package with a CUDA jax into a fresh virtual environment
# (the `cuda13` extra when the driver is 580 or newer, else `cuda12`;
# WHEELS=DIR installs from a local wheel directory instead of the registry),
# records the GPU and the versions, then runs the benchmark with a time
# budget so that everything ends within about 8 minutes: BUDGET_S (default
# 300) seconds after which no new model group starts, and a hard stop at
# BUDGET_S + 150. The models come in order of priority (the goals' first);
# a later session measures the rest with MODELS=soft_s16,vit_s32 (names of
# accelerator_models.MODELS) and OVERHEADS=all|swin|lm|none (default all).
# What it writes to $OUT:
#   gpu.txt          nvidia-smi's name, driver and memory; jax's devices
#   pip.log          the installation's log
#   accelerator.log  the benchmark's output
#   accelerator.json its figures (written after each model, so a hard stop
#                    still leaves the models measured; "partial": true then)
# Copy the JSON's figures into benchmarks/RESULTS.md ("Accelerator") with the
# GPU model and JAX version.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
BUDGET_S="${BUDGET_S:-300}"
mkdir -p "$OUT"
start=$(date +%s)

driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader \
  | head -n 1 | cut -d. -f1)
extra=cuda12
if [ -n "$driver" ] && [ "$driver" -ge 580 ]; then extra=cuda13; fi
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
pip_args=(--quiet)
if [ -n "${WHEELS:-}" ]; then pip_args+=(--no-index --find-links "$WHEELS"); fi
if ! python -m pip install "${pip_args[@]}" -e ".[$extra,tfds]" \
    >"$OUT/pip.log" 2>&1; then
  echo "pip install -e .[$extra,tfds] failed (log: $OUT/pip.log)"
  tail -n 20 "$OUT/pip.log"
  exit 1
fi
echo "installed with [$extra] in $(( $(date +%s) - start )) s"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python -c "import jax; print(jax.__version__, jax.default_backend(), \
jax.devices())"
} >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

args=(--budget-s "$BUDGET_S" --json-out "$OUT/accelerator.json")
if [ -n "${MODELS:-}" ]; then args+=(--models "$MODELS"); fi
if [ -n "${OVERHEADS:-}" ]; then args+=(--overheads "$OVERHEADS"); fi
PYTHONUNBUFFERED=1 timeout --signal=KILL $((BUDGET_S + 150)) \
  python benchmarks/accelerator.py "${args[@]}" 2>&1 \
  | tee "$OUT/accelerator.log"
status=${PIPESTATUS[0]}
echo "accelerator.py exit status $status after $(( $(date +%s) - start )) s"
exit "$status"
