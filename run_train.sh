#!/usr/bin/env bash
# TorchTitan-compatible launcher for torchtitan-autoparallel.
#
#   NGPU=4 CONFIG_FILE=train_configs/llama3_debug_fsdp_tp.toml ./run_train.sh [--section.key=value ...]
#   NGPU=4 MODULE=llama3 CONFIG=llama3_debugmodel ./run_train.sh --parallelism.auto   (TorchTitan 0.3.0)
#
# Environment:
#   NGPU         processes per node (GPUs, or CPU ranks with gloo when no GPU is present); default 8
#   CONFIG_FILE  TorchTitan TOML config; default train_configs/llama3_debug_fsdp.toml
#   MODULE       TorchTitan 0.3.0: the config registry (llama3, qwen3, ...); when set, CONFIG names
#                its config function (default llama3_debugmodel) and the 0.3.0 entry point runs
#   LOG_RANK     comma-separated local ranks whose output is shown; default 0
#   COMM_MODE    "fake_backend": single-process dry run on a fake process group of NGPU ranks,
#                parameters on the meta device (405B/671B fit); builds, shards, reports, exits
#   TRAIN_FILE   python module to run; default torchtitan_autoparallel.titan.v0_2.train
#   PREFLIGHT    1 (default): check the config in one process before starting the ranks
# Multi-node, either release (torchrun's c10d rendezvous; see multinode_trainer.slurm):
#   NNODES       number of nodes; default 1
#   RDZV_ENDPOINT host:port of the rendezvous (the first node), required when NNODES > 1
#   RDZV_ID      job id shared by all nodes; default 101
# Extra arguments pass through as TorchTitan CLI overrides.
set -euo pipefail

NGPU=${NGPU:-8}
NNODES=${NNODES:-1}
export LOG_RANK=${LOG_RANK:-0}
COMM_MODE=${COMM_MODE:-}

die() { echo "error: $*" >&2; exit 2; }

[[ "$NGPU" =~ ^[1-9][0-9]*$ ]] || die "NGPU must be a positive integer, got '$NGPU' (e.g. NGPU=4)"
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$NNODES'"

# The entry point and the job: TorchTitan 0.3.0 when MODULE is set (configs are Python functions:
# MODULE / CONFIG name the config registry and function, as 0.3.0's own run_train.sh does),
# else TorchTitan 0.2.2 with a TOML file. Both launch the same way below, on one node or several.
if [ -n "${MODULE:-}" ]; then
    CONFIG=${CONFIG:-llama3_debugmodel}
    ENTRY=(-m torchtitan_autoparallel.titan.v0_3.train --module "$MODULE" --config "$CONFIG")
    DRY_RUN=(--comm.mode="$COMM_MODE" --training.steps 1)
    PREFLIGHT_ARGS=()
else
    CONFIG_FILE=${CONFIG_FILE:-train_configs/llama3_debug_fsdp.toml}
    TRAIN_FILE=${TRAIN_FILE:-torchtitan_autoparallel.titan.v0_2.train}
    [ -f "$CONFIG_FILE" ] || die "config file not found: $CONFIG_FILE (set CONFIG_FILE to an existing .toml, e.g. train_configs/llama3_debug_fsdp.toml)"
    ENTRY=(-m "$TRAIN_FILE" --job.config_file "$CONFIG_FILE")
    DRY_RUN=(--comm.mode="$COMM_MODE" --training.steps=1)
    PREFLIGHT_ARGS=(--comm.mode=default)
fi

if [ -n "$COMM_MODE" ]; then
    [ "$COMM_MODE" = "fake_backend" ] || die "COMM_MODE must be empty or fake_backend, got '$COMM_MODE'"
    echo "Dry run with comm_mode=${COMM_MODE} on ${NGPU} fake ranks"
    NGPU="$NGPU" LOCAL_RANK=0 RANK=0 WORLD_SIZE="$NGPU" exec python3 "${ENTRY[@]}" "$@" "${DRY_RUN[@]}"
fi

IFS=, read -ra LOG_RANKS <<< "$LOG_RANK"
for r in "${LOG_RANKS[@]}"; do
    [[ "$r" =~ ^[0-9]+$ ]] && [ "$r" -lt "$NGPU" ] || die "LOG_RANK=$LOG_RANK names local rank '$r', but NGPU=$NGPU starts local ranks 0..$((NGPU - 1)) (e.g. LOG_RANK=0)"
done

# Parse and plan the job once, for the whole world, before starting ranks: user mistakes end
# here as one line.
if [ "${PREFLIGHT:-1}" = "1" ]; then
    AUTOPARALLEL_PREFLIGHT=1 NGPU="$NGPU" LOCAL_RANK=0 RANK=0 WORLD_SIZE="$((NGPU * NNODES))" \
        python3 "${ENTRY[@]}" "$@" "${PREFLIGHT_ARGS[@]}" >/dev/null || exit $?
fi

if [ "$NNODES" -gt 1 ]; then
    [ -n "${RDZV_ENDPOINT:-}" ] || die "RDZV_ENDPOINT=host:port is required when NNODES > 1"
    RDZV=(--nnodes "$NNODES" --rdzv_id "${RDZV_ID:-101}" --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT")
else
    RDZV=(--rdzv_backend c10d --rdzv_endpoint "localhost:0")
fi

PYTORCH_ALLOC_CONF="expandable_segments:True" \
exec torchrun --nproc_per_node="$NGPU" "${RDZV[@]}" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 "${ENTRY[@]}" "$@"
