#!/usr/bin/env bash
# One prepared GPU session (issue 48 item 5): at most 9 minutes, parts in priority order, each
# with its own timeout and its own output folder under $OUT, so a kill loses only the part it
# hits. Run from the repository root:
#
#   OUT=/some/folder benchmarks/gpu_session.sh           # on the GPU (the `run` tool's $OUT)
#   OUT=/tmp/s benchmarks/gpu_session.sh --smoke         # every part at a tiny size on CPU (CI)
#
# Parts in priority order. First the dress rehearsal (issue 48 item 2: the main job has never
# run at real size on a GPU, and its per-phase table is what the protocol's extrapolation
# needs), then the like-for-like HF ratios and the remat comparison (item 4). The session has
# SESSION_S = 540 s in all and a part's timeout is its own or what is left of them, whichever is
# smaller (one with under 30 s left is skipped):
#   0. device          (~5)  nvidia-smi, benchmarks/device_info.py's record and an import
#                            check, into session.txt;
#   1. rehearsal       (330) benchmarks/protocol_gpu.py: the main job at real size, per phase
#                            (each phase's record is written when it ends: a killed run keeps
#                            the others); skipped when the imports of the device part fail;
#   2. hf_model        (90)  benchmarks/step.py, model alone, no remat on either side, 4 + 4
#                            images (HF's model alone needed 88.3 GB at 8 + 8): ours against
#                            HF's forward + backward, each in its own process;
#   3. hf_step         (90)  benchmarks/step.py, the full step at 4 + 4: ours (bf16, remat per
#                            block, JAX matcher) against HF's (SciPy matching, the same loss,
#                            AdamW);
#   --- what 540 s holds ends about here: parts 4-7 are the second call (below) ---
#   4. remat_block     (120) benchmarks/step.py, our L/14 step at 16 + 16, remat per block,
#                            with the FLOP arithmetic of that configuration (MFU and HFU);
#   5. remat_selective (120) the same with remat=$SELECTIVE (dots_with_no_batch_dims_saveable:
#                            the weight matmuls' outputs kept, attention, softmax, LayerNorm
#                            and GELU recomputed), in its own process, the same batch (the
#                            arithmetic's 6.93 + 32 x 2.35 = 82 GB fits an H200, not surely an
#                            80 GB H100: an out-of-memory is recorded as the side's error);
#   6. retrieval       (90)  benchmarks/retrieval.py at N = 1M buffer images, every
#                            registered algorithm (its default list), one process;
#   7. owlv2           (120) benchmarks/step.py, OWLv2 L/14 at 1008 px, 16 + 16, remat per
#                            block: peak memory and MFU.
# One lent session (15 minutes of device time, the machine's start included) holds the first
# call; the second, `PARTS="remat_block remat_selective retrieval owlv2"`, goes to the next
# session that is lent a GPU (or to this one's rest if the first ended early). Put the parts of
# both calls in one folder before reading them.
# benchmarks/gpu_report.py reads $OUT afterwards and states each item-4 goal as met / not met
# / not measured, with its figure and file.
# PARTS (a space-separated list, default every part, in the order above) runs only those parts: the CI smoke runs
# `PARTS=rehearsal` (the step.py parts' smoke runs in tests/benchmarks/test_benchmark_step.py;
# each of them took over 4 min of a loaded 2-core CPU here, which CI has not to spare).
# Each part's output goes to $OUT/<part>.tgz (the folder <part>/ with its JSON result and
# log.txt, which holds the Markdown table the script printed; the .md copies are removed): the
# device machine returns at most 8 files, so each part is one archive, packed when it ends or
# is killed. $OUT/session.txt gets the device record and one line per part: its name, exit
# status (124: killed at its timeout), seconds and timeout. Commit the folder unedited
# (benchmarks/results/gpu_session_<n>/) beside the page benchmarks/gpu_report.py writes.
#
# The device machine lacks some of the project's packages and has no network: carry their
# wheels, downloaded here for the device machine's Python and platform. In the repository
# root here, with `.whl/` in .git/info/exclude:
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

PARTS=${PARTS:-rehearsal hf_model hf_step remat_block remat_selective retrieval owlv2}
SELECTIVE=${SELECTIVE:-dots_with_no_batch_dims_saveable}
# On CPU (--smoke) the parts are slower per unit of work: generous timeouts; on the GPU the
# 9-minute plan above.
if [ -n "$smoke" ]; then scale=4 repeats=1 big=2 million=""; else
  scale=1 repeats=5 big=32 million="--sizes=1000000"; fi
session_end=$(($(date +%s) + ${SESSION_S:-540} * scale))
part() {  # part NAME TIMEOUT COMMAND...: runs COMMAND with its output in $OUT/NAME/log.txt
  local name=$1 limit=$2 start left
  shift 2
  case " $PARTS " in *" $name "*) ;; *) echo "$name not in PARTS" >>"$OUT/session.txt"; return ;; esac
  left=$((session_end - $(date +%s)))
  if [ "$left" -lt 30 ]; then
    echo "$name skipped: $left s of the session left" | tee -a "$OUT/session.txt"
    return
  fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  mkdir -p "$OUT/$name"
  start=$(date +%s)
  # -k: a part that ignores SIGTERM is killed 5 s later (its children too: its own group).
  timeout -k 5 "$limit" "$@" >"$OUT/$name/log.txt" 2>&1
  local status=$?
  rm -f "$OUT/$name"/*.md  # printed into log.txt already
  # One archive per part: the device machine returns at most 8 files (session.txt and 7 parts).
  tar -czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "${OUT:?}/$name"
  echo "$name exit $status $(($(date +%s) - start)) s (timeout $limit s)" | tee -a "$OUT/session.txt"
}

{
  nvidia-smi || true
  "$py" benchmarks/device_info.py
} >>"$OUT/session.txt" 2>&1
# step.py's options shared by the parts that time our step alone at 16 + 16: the arithmetic of
# the timed configuration only (its FLOPs per image give MFU and HFU), no LoRA, no HF.
ours_only="--skip-lora --skip-hf --skip-model-only --matchers=jax --dtypes=bfloat16
  --attentions=xla --batches=$big --time-batches=$big --repeats=$repeats"
imports="import grain, pycocotools, lvis, ml_collections, tensorboardX, qwix"
case " $PARTS " in *" rehearsal "*)
  if "$py" -c "$imports" >>"$OUT/session.txt" 2>&1; then
    part rehearsal $((330 * scale)) "$py" benchmarks/protocol_gpu.py $smoke \
      --out "$OUT/rehearsal" --timeout $((320 * scale))
  else
    echo "rehearsal skipped: the imports above failed ($imports)" | tee -a "$OUT/session.txt"
  fi ;;
esac
part hf_model $((90 * scale)) "$py" benchmarks/step.py $smoke --skip-arithmetic --skip-lora \
  --skip-step --remat=none --time-batches=8 --repeats=$repeats --out "$OUT/hf_model"
part hf_step $((90 * scale)) "$py" benchmarks/step.py $smoke --skip-arithmetic --skip-lora \
  --skip-model-only --matchers=jax --time-batches=8 --repeats=$repeats --out "$OUT/hf_step"
# shellcheck disable=SC2086  # $ours_only is a list of options
part remat_block $((120 * scale)) "$py" benchmarks/step.py $smoke $ours_only --remats=block \
  --remat=block --out "$OUT/remat_block"
# shellcheck disable=SC2086
part remat_selective $((120 * scale)) "$py" benchmarks/step.py $smoke $ours_only \
  --remats="$SELECTIVE" --remat="$SELECTIVE" --out "$OUT/remat_selective"
# shellcheck disable=SC2086
part retrieval $((90 * scale)) "$py" benchmarks/retrieval.py $smoke $million --repeats=10 \
  --skip-kernels --skip-floors --skip-precompute --out "$OUT/retrieval"
# shellcheck disable=SC2086
part owlv2 $((120 * scale)) "$py" benchmarks/step.py $smoke $ours_only --variant=owlv2_l14 \
  --remats=block --remat=block --out "$OUT/owlv2"
