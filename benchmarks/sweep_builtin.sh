#!/usr/bin/env bash
# The committed sweep of the built-in benchmark version 2 (docs/experiments.md, "The committed
# sweep"): every retrieval algorithm, no_replay and every baseline, 5 seeds x 2 stored task
# orders, 2 runs at a time, then the report the README's tables come from.
#
#   bash benchmarks/sweep_builtin.sh [ROOT]      # default ROOT: workdirs/sweep_builtin2
#
# Resumable: run it again after a kill and complete runs are skipped, an interrupted one
# resumes (launch/sweep.py --run). Groups run in priority order (every algorithm on the first
# order before the second order), so a sweep stopped early still gives n = 5 per algorithm.
# A group that fails does not stop the next; the script's status is the first failure's.
# The report is written to benchmarks/results/sweep_builtin/ (report.md, report.json, PNGs).
set -u
cd "$(dirname "$0")/.."
ROOT=${1:-workdirs/sweep_builtin2}
PROCESSES=${PROCESSES:-2}
SEEDS=0,1,2,3,4
RETRIEVAL=no_replay,uniform,uniform_balanced,swil,grasp,sw_grasp,a_sw_grasp,aser,aser_pc,sw_aser_pc
BASELINES=joint,per_task,lwf,heads_only,lora
status=0
for order in random_0 random_1; do
  for algorithms in "$RETRIEVAL" "$BASELINES"; do
    python launch/sweep.py --config-arg=builtin2 --algorithms="$algorithms" --orders="$order" \
      --seeds="$SEEDS" --root="$ROOT" --run --processes="$PROCESSES" || {
      rc=$?
      echo "sweep group failed (status $rc): $algorithms on $order" >&2
      [ "$status" -ne 0 ] || status=$rc
    }
  done
done
python -m owl_cl.report "$ROOT" --reference uniform --out benchmarks/results/sweep_builtin || {
  rc=$?
  [ "$status" -ne 0 ] || status=$rc
}
exit "$status"
