#!/bin/bash
# Runs one owl_cl command on every worker of a Cloud TPU VM (a pod slice has several hosts;
# each runs the same command and `--distributed` joins them into one JAX runtime through
# jax.distributed.initialize(), which reads the coordinator from the TPU metadata).
#
#   launch/tpu_vm.sh [--setup] TPU_NAME ZONE -- python -m owl_cl.main \
#       --config=configs/swil.py:paper --config.data.root=/mnt/data \
#       --workdir=/mnt/shared/workdirs/swil_seed0 --config.sequence_seed=0
#
# --setup first installs the package on every worker (pip install -e ".[tpu]" in the repo
# folder, which must already be on every worker, e.g. by `git clone` or `gcloud ... scp`).
# The workdir and data must be on storage every worker sees (Filestore / NFS, gcsfuse).
# Environment: TPU_PROJECT (gcloud project, default: gcloud's), OWL_CL_REPO (repo folder on
# the workers, default ~/owl_cl), DRY_RUN=1 (print the gcloud command, run nothing).
set -euo pipefail

usage() { echo "usage: $0 [--setup] TPU_NAME ZONE -- COMMAND..." >&2; exit 2; }

SETUP=0
if [[ "${1:-}" == "--setup" ]]; then SETUP=1; shift; fi
[[ $# -ge 4 && "$3" == "--" ]] || usage
TPU_NAME="$1"; ZONE="$2"; shift 3

REPO_DIR="${OWL_CL_REPO:-~/owl_cl}"
COMMAND="$(printf '%q ' "$@")"
# Every host must join the same runtime: add --distributed to owl_cl.main if missing.
if [[ " $* " == *" owl_cl.main "* && " $* " != *" --distributed "* ]]; then
  COMMAND="${COMMAND}--distributed"
fi
REMOTE="cd $REPO_DIR"
if [[ "$SETUP" == 1 ]]; then
  REMOTE="$REMOTE && python3 -m pip install -q -e '.[tpu]'"
fi
REMOTE="$REMOTE && $COMMAND"

GCLOUD=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all
        --command="$REMOTE")
if [[ -n "${TPU_PROJECT:-}" ]]; then GCLOUD+=(--project="$TPU_PROJECT"); fi

if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%q ' "${GCLOUD[@]}"; echo
else
  exec "${GCLOUD[@]}"
fi
