#!/usr/bin/env bash
# The committed sweep of the built-in benchmark version 2 (docs/experiments.md, "The committed
# sweep"): the first design of launch/designs.py (`builtin`: its 15 rows, 5 seeds x 2 stored
# task orders), 2 runs at a time, then the report the README's tables come from.
#
#   bash benchmarks/sweep_builtin.sh [ROOT]      # default ROOT: workdirs/sweep_builtin2
#   REPORT_ONLY=1 bash benchmarks/sweep_builtin.sh [ROOT]   # the report of the runs so far
#
# Resumable: run it again after a kill and complete runs are skipped, an interrupted one
# resumes. Runs go in priority order (every row on the first order before the second order),
# so a sweep stopped early still gives n = 5 per row; a failed run does not stop the others,
# and the script's status is the first failure's. The report is written to
# benchmarks/results/sweep_builtin/ (report.md, report.json, PNGs, by_order/, interference.md)
# from the runs' results.json copied to benchmarks/results/sweep_builtin/runs/
# (launch/sweep_design.py).
set -u
cd "$(dirname "$0")/.."
ROOT=${1:-workdirs/sweep_builtin2}
MODE=--run
[ "${REPORT_ONLY:-0}" = 1 ] && MODE=--report-only
exec python launch/sweep_design.py builtin "$MODE" --root="$ROOT" --processes="${PROCESSES:-2}"
