#!/usr/bin/env bash
# One prepared GPU session (issue 48 item 5): at most 9 minutes, parts in priority order, each
# with its own timeout and its own output folder under $OUT, so a kill loses only the part it
# hits. Run from the repository root:
#
#   OUT=/some/folder benchmarks/gpu_session.sh           # on the GPU (the `run` tool's $OUT)
#   OUT=/tmp/s benchmarks/gpu_session.sh --smoke         # every part at a tiny size on CPU (CI)
#
# Parts (seconds of timeout; their sum is the session's 540):
#   0. device    (10)  nvidia-smi and benchmarks/device_info.py's record of the device;
#   1. rehearsal (330) benchmarks/protocol_gpu.py: the main job at real size, per phase (each
#                      phase's record is written when it ends: a killed run keeps the others);
#   2. hf_model  (100) benchmarks/step.py, model alone, no remat on either side, 4 + 4 images
#                      (HF's model alone needed 88.3 GB at 8 + 8): ours against HF's
#                      forward + backward, each in its own process;
#   3. hf_step   (100) benchmarks/step.py, the full step at 4 + 4: ours (bf16, remat per
#                      block, JAX matcher) against HF's (SciPy matching, the same loss, AdamW).
# Each part's output (its result files and log.txt) goes to $OUT/<part>/; $OUT/session.txt
# gets one line per part: its name, exit status (124: killed at its timeout) and seconds.
# Commit the folder unedited (benchmarks/results/gpu_session_<n>/) beside a page that reads it.
set -u
: "${OUT:?set OUT to the output folder}"
smoke=""
if [ "${1:-}" = "--smoke" ]; then smoke="--smoke"; fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

part() {  # part NAME TIMEOUT COMMAND...: runs COMMAND with its output in $OUT/NAME/log.txt
  local name=$1 limit=$2 start
  shift 2
  mkdir -p "$OUT/$name"
  start=$(date +%s)
  # -k: a part that ignores SIGTERM is killed 5 s later (its children too: its own group).
  timeout -k 5 "$limit" "$@" >"$OUT/$name/log.txt" 2>&1
  local status=$?
  echo "$name exit $status $(($(date +%s) - start)) s" | tee -a "$OUT/session.txt"
}

# On CPU (--smoke) the parts are slower per unit of work: generous timeouts; on the GPU the
# 9-minute plan above.
if [ -n "$smoke" ]; then scale=4 repeats=1; else scale=1 repeats=5; fi
part device $((10 * scale)) sh -c 'nvidia-smi || true; python benchmarks/device_info.py'
part rehearsal $((330 * scale)) python benchmarks/protocol_gpu.py $smoke --out "$OUT/rehearsal" \
  --timeout $((320 * scale))
part hf_model $((100 * scale)) python benchmarks/step.py $smoke --skip-arithmetic --skip-lora \
  --skip-step --remat=none --time-batches=8 --repeats=$repeats --out "$OUT/hf_model"
part hf_step $((100 * scale)) python benchmarks/step.py $smoke --skip-arithmetic --skip-lora \
  --skip-model-only --matchers=jax --time-batches=8 --repeats=$repeats --out "$OUT/hf_step"
