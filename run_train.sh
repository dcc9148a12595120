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
# Multi-node (torchrun rendezvous; see multinode_trainer.slurm):
#   NNODES       number of nodes; default 1
#   RDZV_ENDPOINT host:port of the rendezvous (the first node), required when NNODES > 1
#   RDZV_ID      job id shared by all nodes; default 101
# Extra arguments pass through as TorchTitan CLI overrides.
set -euo pipefail

# TorchTitan 0.3.0 (configs are Python functions): MODULE / CONFIG name the config registry and
# function, as 0.3.0's own run_train.sh does; the 0.3.0 entry point trains with its Trainer.
#   NGPU=4 MODULE=llama3 CONFIG=llama3_debugmodel ./run_train.sh --parallelism.auto [overrides]
if [ -n "${MODULE:-}" ]; then
    NGPU=${NGPU:-8}
    export LOG_RANK=${LOG_RANK:-0}
    CONFIG=${CONFIG:-llama3_debugmodel}
    COMM_MODE=${COMM_MODE:-}
    [[ "$NGPU" =~ ^[1-9][0-9]*$ ]] || { echo "error: NGPU must be a positive integer, got '$NGPU' (e.g. NGPU=4)" >&2; exit 2; }
    if [ -n "$COMM_MODE" ]; then
        echo "Running with comm_mode=${COMM_MODE}"
        NGPU="$NGPU" LOCAL_RANK=0 exec python3 -m torchtitan_autoparallel.titan.v0_3.train \
            --module "$MODULE" --config "$CONFIG" "$@" --comm.mode="$COMM_MODE" --training.steps 1
    fi
    # parse (and plan) the job once before starting ranks: mistakes end here as one line
    if [ "${PREFLIGHT:-1}" = "1" ]; then
        AUTOPARALLEL_PREFLIGHT=1 NGPU="$NGPU" LOCAL_RANK=0 RANK=0 WORLD_SIZE="$NGPU" \
            python3 -m torchtitan_autoparallel.titan.v0_3.train --module "$MODULE" \
            --config "$CONFIG" "$@" >/dev/null || exit $?
    fi
    PYTORCH_ALLOC_CONF="expandable_segments:True" \
    exec torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
        --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
        -m torchtitan_autoparallel.titan.v0_3.train --module "$MODULE" --config "$CONFIG" "$@"
fi

NGPU=${NGPU:-8}
CONFIG_FILE=${CONFIG_FILE:-train_configs/llama3_debug_fsdp.toml}
export LOG_RANK=${LOG_RANK:-0}
COMM_MODE=${COMM_MODE:-}
TRAIN_FILE=${TRAIN_FILE:-torchtitan_autoparallel.titan.v0_2.train}
NNODES=${NNODES:-1}

die() { echo "error: $*" >&2; exit 2; }

[[ "$NGPU" =~ ^[1-9][0-9]*$ ]] || die "NGPU must be a positive integer, got '$NGPU' (e.g. NGPU=4)"
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$NNODES'"
[ -f "$CONFIG_FILE" ] || die "config file not found: $CONFIG_FILE (set CONFIG_FILE to an existing .toml, e.g. train_configs/llama3_debug_fsdp.toml)"

if [ -n "$COMM_MODE" ]; then
    [ "$COMM_MODE" = "fake_backend" ] || die "COMM_MODE must be empty or fake_backend, got '$COMM_MODE'"
    echo "Dry run with comm_mode=${COMM_MODE} on ${NGPU} fake ranks"
    NGPU="$NGPU" LOCAL_RANK=0 RANK=0 WORLD_SIZE="$NGPU" exec python3 -m "$TRAIN_FILE" \
        --job.config_file "$CONFIG_FILE" "$@" --comm.mode="$COMM_MODE" --training.steps=1
fi

# Parse and check the job once, before starting ranks: user mistakes end here as one line.
if [ "${PREFLIGHT:-1}" = "1" ]; then
    AUTOPARALLEL_PREFLIGHT=1 NGPU="$NGPU" LOCAL_RANK=0 RANK=0 WORLD_SIZE="$((NGPU * NNODES))" \
        python3 -m "$TRAIN_FILE" --job.config_file "$CONFIG_FILE" "$@" --comm.mode=default \
        >/dev/null || exit $?
fi

if [ "$NNODES" -gt 1 ]; then
    [ -n "${RDZV_ENDPOINT:-}" ] || die "RDZV_ENDPOINT=host:port is required when NNODES > 1"
    RDZV=(--nnodes "$NNODES" --rdzv_id "${RDZV_ID:-101}" --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT")
else
    RDZV=(--rdzv_backend c10d --rdzv_endpoint "localhost:0")
fi

PYTORCH_ALLOC_CONF="expandable_segments:True" \
exec torchrun --nproc_per_node="$NGPU" "${RDZV[@]}" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m "$TRAIN_FILE" --job.config_file "$CONFIG_FILE" "$@"
