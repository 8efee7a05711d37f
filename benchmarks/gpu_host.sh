#!/usr/bin/env bash
# The GPU check on a GPU host with no network (run from the repository's root, with the wheels
# of `make gpu-wheels` in .whl/): installs them into a folder of their own, lays tandem out as
# the package it installs as, runs
# benchmarks/gpu_check.py with any arguments given, and copies its JSON to $OUT when that is set.
set -euo pipefail
site=/tmp/tandem-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
# tandem.<part> -> the repository's <part>/, as links inside tandem/ itself (pytest puts the
# repository's root first on sys.path, so a layout elsewhere would be shadowed by the bare
# tandem/); removed again on exit.
made=()
cleanup() { for link in "${made[@]}"; do rm -f "$link"; done; }
trap cleanup EXIT
for part in core engines tasks pipeline algorithms param_sync state_machines configs; do
    if [ ! -e "tandem/$part" ]; then ln -s "../$part" "tandem/$part"; made+=("tandem/$part"); fi
done
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 TANDEM_COMMIT="${TANDEM_COMMIT:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
status=0
python3 benchmarks/gpu_check.py "$@" || status=$?
if [ -n "${OUT:-}" ] && [ -f benchmarks/results/gpu_check.json ]; then
    cp benchmarks/results/gpu_check.json "$OUT/"
fi
exit $status
