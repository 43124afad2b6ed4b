#!/usr/bin/env bash
# The second committed sweep (docs/design_round2.md): the design `round2` of launch/designs.py
# (every retrieval algorithm, every baseline, WiSE-FT alone over alpha and with replay, x model
# seeds 0-2 x the stored orders random_0-random_3), 2 runs at a time, then its report with the
# analysis plan `round2`.
#
#   bash benchmarks/sweep_round2.sh [ROOT]      # default ROOT: workdirs/sweep_round2
#   REPORT_ONLY=1 bash benchmarks/sweep_round2.sh [ROOT]   # the report of the runs so far
#
# Resumable (complete runs skipped, an interrupted one resumed); the (model seed, order) cells
# run one after another with every row in each, so a sweep stopped early has complete cells
# for every row. The runs of each cell are copied to benchmarks/results/sweep_round2/runs/
# once the cell is whole: commit that folder, and the same command on a fresh machine runs
# only the rest (docs/design_round2.md, "Over more than one sitting"). The report goes to
# benchmarks/results/sweep_round2/ (launch/sweep_design.py).
set -u
cd "$(dirname "$0")/.."
ROOT=${1:-workdirs/sweep_round2}
MODE=--run
[ "${REPORT_ONLY:-0}" = 1 ] && MODE=--report-only
exec python launch/sweep_design.py round2 "$MODE" --root="$ROOT" --processes="${PROCESSES:-2}"
