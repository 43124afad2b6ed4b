#!/usr/bin/env bash
# The committed sweep of the built-in benchmark version 2 (docs/experiments.md, "The committed
# sweep"): every retrieval algorithm, no_replay and every baseline, 5 seeds x 2 stored task
# orders, 2 runs at a time, then the report the README's tables come from.
#
#   bash benchmarks/sweep_builtin.sh [ROOT]      # default ROOT: workdirs/sweep_builtin2
#   REPORT_ONLY=1 bash benchmarks/sweep_builtin.sh [ROOT]   # the report of the runs so far
#
# Resumable: run it again after a kill and complete runs are skipped, an interrupted one
# resumes (launch/sweep.py --run). Groups run in priority order (every algorithm on the first
# order before the second order), so a sweep stopped early still gives n = 5 per algorithm.
# A group that fails does not stop the next; the script's status is the first failure's.
# The report is written to benchmarks/results/sweep_builtin/ (report.md, report.json, PNGs),
# from the runs' results.json copied to benchmarks/results/sweep_builtin/runs/.
set -u
cd "$(dirname "$0")/.."
ROOT=${1:-workdirs/sweep_builtin2}
PROCESSES=${PROCESSES:-2}
SEEDS=0,1,2,3,4
RETRIEVAL=no_replay,uniform,uniform_balanced,swil,grasp,sw_grasp,a_sw_grasp,aser,aser_pc,sw_aser_pc
BASELINES=joint,per_task,lwf,heads_only,lora
status=0
# REPORT_ONLY=1: no runs, only the copy and the report of the complete runs in ROOT.
[ "${REPORT_ONLY:-0}" = 1 ] || for order in random_0 random_1; do
  for algorithms in "$RETRIEVAL" "$BASELINES"; do
    python launch/sweep.py --config-arg=builtin2 --algorithms="$algorithms" --orders="$order" \
      --seeds="$SEEDS" --root="$ROOT" --run --processes="$PROCESSES" || {
      rc=$?
      echo "sweep group failed (status $rc): $algorithms on $order" >&2
      [ "$status" -ne 0 ] || status=$rc
    }
  done
done
# The runs' results.json (53 KB each; checkpoints stay in ROOT) are copied into the repository,
# so that the report below is reproduced from committed files alone (a test checks that the
# README's table is this report's).
OUT=benchmarks/results/sweep_builtin
for results in "$ROOT"/*/results.json; do
  name=$(basename "$(dirname "$results")")
  # Complete runs only (a run stopped midway is left in ROOT, where a re-run resumes it).
  python -c 'import json,sys; sys.exit(json.load(open(sys.argv[1]))["status"] != "complete")' \
    "$results" || continue
  mkdir -p "$OUT/runs/$name" && cp "$results" "$OUT/runs/$name/results.json"
done
# The summary table's rows: lower bounds, the retrieval algorithms, upper bounds (those with
# runs: a sweep stopped early still reports).
ORDER=""
for a in no_replay lwf heads_only lora uniform uniform_balanced swil grasp sw_grasp a_sw_grasp \
  aser aser_pc sw_aser_pc joint per_task; do
  compgen -G "$OUT/runs/${a}_random_*" > /dev/null && ORDER=$ORDER${ORDER:+,}$a
done
python -m owl_cl.report "$OUT/runs" --reference uniform --order "$ORDER" --out "$OUT" || {
  rc=$?
  [ "$status" -ne 0 ] || status=$rc
}
# Factor 4 (the order effect): the same report for each order's runs alone (its AP per eval set
# shows where each dataset ends up after the order's later datasets).
for order in random_0 random_1; do
  compgen -G "$OUT/runs/*_${order}_seed*" > /dev/null || continue
  python -m owl_cl.report "$OUT"/runs/*_"${order}"_seed* --reference uniform --order "$ORDER" \
    --out "$OUT/by_order/$order" || {
    rc=$?
    [ "$status" -ne 0 ] || status=$rc
  }
done
# Factor 3 (interference): the named classes' share of the class-step replays, from the runs'
# retrieval records (in ROOT only: records are not copied).
python -m owl_cl.analysis.interference "$ROOT" --out "$OUT/interference.md" || {
  rc=$?
  [ "$status" -ne 0 ] || status=$rc
}
exit "$status"
