#!/usr/bin/env bash
# The GPU check on a GPU host with no network (run from the repository's root, with the wheels
# of `make gpu-wheels` in .whl/): installs them into a folder of their own, lays tandem out as
# the package it installs as (tandem.<part> -> the repository's folders), runs
# benchmarks/gpu_check.py with any arguments given, and copies its JSON to $OUT when that is set.
set -euo pipefail
site=/tmp/tandem-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
layout=/tmp/tandem-layout
rm -rf "$layout" && mkdir -p "$layout/tandem"
cp tandem/__init__.py "$layout/tandem/"
for part in core engines tasks pipeline algorithms param_sync state_machines configs; do
    ln -s "$PWD/$part" "$layout/tandem/$part"
done
export PYTHONPATH="$site:$layout:$PWD" PYTHONUNBUFFERED=1 TANDEM_COMMIT="${TANDEM_COMMIT:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
status=0
python3 benchmarks/gpu_check.py "$@" || status=$?
if [ -n "${OUT:-}" ] && [ -f benchmarks/results/gpu_check.json ]; then
    cp benchmarks/results/gpu_check.json "$OUT/"
fi
exit $status
