#!/usr/bin/env bash
# OWLv2 beside OWL-ViT v1 on the built-in benchmark (version 1, `configs/swil.py:builtin1` against
# `configs/swil.py:owlv2,builtin1`: the model and its objectness loss term are the only
# differences; version 1 was the default when the committed runs ran),
# seeds 0-4 of `seeds.data` and `seeds.retrieval` (the pre-trained model and the buffer are
# shared by the seeds of one model), one run at a time per model, then one report per model.
#
#   bash benchmarks/owlv2_builtin.sh [ROOT]    # default ROOT: workdirs/owlv2_builtin
#   REPORT_ONLY=1 bash benchmarks/owlv2_builtin.sh [ROOT]
#   CACHE_V1=DIR CACHE_V2=DIR bash benchmarks/owlv2_builtin.sh [ROOT]   # other cache folders
#
# Resumable (complete runs are skipped). The results.json of complete runs are copied to
# benchmarks/results/owlv2_builtin/{v1,v2}/ and each model's report written beside them
# (`python -m owl_cl.report`: mean and 95% interval per metric over the seeds), then both
# summaries in one table, `summary.md` (docs/owlv2.md's table; a test checks it).
set -u
cd "$(dirname "$0")/.."
ROOT=${1:-workdirs/owlv2_builtin}
SEEDS=0,1,2,3,4
OUT=benchmarks/results/owlv2_builtin
status=0
for model in v1 v2; do
  arg="--config-arg=builtin1"
  [ "$model" = v1 ] || arg="--config-arg=owlv2,builtin1"
  cache_var="CACHE_${model^^}"
  cache=${!cache_var:-}
  fixed=()
  [ -z "$cache" ] || fixed=(--fixed "cache_dir=$cache")
  if [ "${REPORT_ONLY:-0}" != 1 ]; then
    python launch/sweep.py --algorithms=swil --seeds="$SEEDS" \
      --seed-fields=seeds.data,seeds.retrieval $arg "${fixed[@]}" --root="$ROOT/$model" \
      --run --processes=1 || {
      rc=$?
      echo "sweep failed (status $rc): $model" >&2
      [ "$status" -ne 0 ] || status=$rc
    }
  fi
  for results in "$ROOT/$model"/*/results.json; do
    [ -e "$results" ] || continue
    name=$(basename "$(dirname "$results")")
    python -c 'import json,sys; sys.exit(json.load(open(sys.argv[1]))["status"] != "complete")' \
      "$results" || continue
    mkdir -p "$OUT/$model/runs/$name" && cp "$results" "$OUT/$model/runs/$name/results.json"
  done
  python -m owl_cl.report "$OUT/$model/runs" --reference swil --out "$OUT/$model" || {
    rc=$?
    [ "$status" -ne 0 ] || status=$rc
  }
done
# docs/owlv2.md's table: both reports' summaries in one table (report.render_labelled_summary).
python - "$OUT" > "$OUT/summary.md" <<'EOF' || { [ "$status" -ne 0 ] || status=1; }
import os, sys
from owl_cl.analysis import report as r
def report(model):
  runs = r.find_runs([os.path.join(sys.argv[1], model, "runs")])
  return r.build_report(r.load_points(runs), "swil")
reports = {"OWL-ViT v1": report("v1"), "OWLv2": report("v2")}
print(r.render_labelled_summary(reports), end="")
EOF
exit "$status"
