#!/usr/bin/env bash
# One prepared GPU session (issue 48 item 5): at most 9 minutes, parts in priority order, each
# with its own timeout and its own output folder under $OUT, so a kill loses only the part it
# hits. Run from the repository root:
#
#   OUT=/some/folder benchmarks/gpu_session.sh           # on the GPU (the `run` tool's $OUT)
#   OUT=/tmp/s benchmarks/gpu_session.sh --smoke         # every part at a tiny size on CPU (CI)
#
# Parts (seconds of timeout; their sum is the session's 540):
#   0. device    (~5)  nvidia-smi, benchmarks/device_info.py's record and an import check,
#                      into session.txt;
#   1. rehearsal (330) benchmarks/protocol_gpu.py: the main job at real size, per phase (each
#                      phase's record is written when it ends: a killed run keeps the others);
#   2. hf_model  (100) benchmarks/step.py, model alone, no remat on either side, 4 + 4 images
#                      (HF's model alone needed 88.3 GB at 8 + 8): ours against HF's
#                      forward + backward, each in its own process;
#   3. hf_step   (100) benchmarks/step.py, the full step at 4 + 4: ours (bf16, remat per
#                      block, JAX matcher) against HF's (SciPy matching, the same loss, AdamW).
# PARTS (a space-separated list, default all) runs only those parts: the CI smoke runs
# `PARTS=rehearsal` (the HF parts' step.py smoke runs in tests/benchmarks/test_benchmark_step.py;
# each of them took over 4 min of a loaded 2-core CPU here, which CI has not to spare).
# Each part's output goes to $OUT/<part>/: its JSON result and log.txt (which holds the
# Markdown table the script printed; the .md copies are removed, as the device machine returns
# at most 8 files: 7 come back); $OUT/session.txt gets the device record and one line per
# part: its name, exit status (124: killed at its timeout) and seconds. Commit the folder
# unedited (benchmarks/results/gpu_session_<n>/) beside a page that reads it.
#
# The device machine lacks some of the project's packages and has no network: carry their
# wheels (/work/.library/device/README.md, "a Python package missing there"). In the
# repository root here, with `.whl/` in .git/info/exclude:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl grain array_record portpicker ml_collections \
#     pycocotools lvis tensorboardX qwix
# and run (the `run` tool, carry ['.whl'], timeout_s 580):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site && PYTHONUNBUFFERED=1 benchmarks/gpu_session.sh
# The `device` part checks the imports first: without them the rehearsal is skipped (the HF
# parts need only ml_collections and qwix).
set -u
: "${OUT:?set OUT to the output folder}"
smoke=""
if [ "${1:-}" = "--smoke" ]; then smoke="--smoke"; fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
py="${PYTHON:-python3}"

PARTS=${PARTS:-rehearsal hf_model hf_step}
part() {  # part NAME TIMEOUT COMMAND...: runs COMMAND with its output in $OUT/NAME/log.txt
  local name=$1 limit=$2 start
  shift 2
  case " $PARTS " in *" $name "*) ;; *) echo "$name not in PARTS" >>"$OUT/session.txt"; return ;; esac
  mkdir -p "$OUT/$name"
  start=$(date +%s)
  # -k: a part that ignores SIGTERM is killed 5 s later (its children too: its own group).
  timeout -k 5 "$limit" "$@" >"$OUT/$name/log.txt" 2>&1
  local status=$?
  rm -f "$OUT/$name"/*.md  # printed into log.txt already
  echo "$name exit $status $(($(date +%s) - start)) s" | tee -a "$OUT/session.txt"
}

# On CPU (--smoke) the parts are slower per unit of work: generous timeouts; on the GPU the
# 9-minute plan above.
if [ -n "$smoke" ]; then scale=4 repeats=1; else scale=1 repeats=5; fi
{
  nvidia-smi || true
  "$py" benchmarks/device_info.py
} >>"$OUT/session.txt" 2>&1
imports="import grain, pycocotools, lvis, ml_collections, tensorboardX, qwix"
if "$py" -c "$imports" >>"$OUT/session.txt" 2>&1; then
  part rehearsal $((330 * scale)) "$py" benchmarks/protocol_gpu.py $smoke --out "$OUT/rehearsal" \
    --timeout $((320 * scale))
else
  echo "rehearsal skipped: the imports above failed ($imports)" | tee -a "$OUT/session.txt"
fi
part hf_model $((100 * scale)) "$py" benchmarks/step.py $smoke --skip-arithmetic --skip-lora \
  --skip-step --remat=none --time-batches=8 --repeats=$repeats --out "$OUT/hf_model"
part hf_step $((100 * scale)) "$py" benchmarks/step.py $smoke --skip-arithmetic --skip-lora \
  --skip-model-only --matchers=jax --time-batches=8 --repeats=$repeats --out "$OUT/hf_step"
