#!/bin/bash
# Collect tensors (high precision, quantized, statistics) from short training runs, one run per
# quantization scheme, and report what each run wrote.
#
# Usage:
#   ./run_tensor_collection.sh [MODE] [QUANT_SCHEME ...] [options] [-- pretrain_gpt.py flags]
#
# Modes:
#   single   one quantization scheme (default: FA_linear_mxfp8)
#   batch    several schemes one after the other (default: all ten)
#   quick    a smoke test: tiny model (llama-tiny), fast training config, mock data
#
# QUANT_SCHEME is a scheme (bf16, FA_mxfp8, ..., FA_linear_hifp8; `python train_config.py --list`)
# or a bare format mxfp8/mxfp4/hifp8, meaning FA_linear_<fmt> as in the original scripts (which
# called it QUANT_TYPE).
#
# Options:
#   --mode MODE                  single, batch or quick (instead of the positional MODE)
#   --quant-scheme S[,S...]      scheme(s) to collect; may be repeated (--quant-type: the same)
#   --control-iter N             capture iterations 1..N, then the run ends (default 1)
#   --collect-micro-batches M    micro-batches captured per iteration (default 1)
#   --model NAME                 default: llama32-1b with a GPU, llama-tiny without (quick: llama-tiny)
#   --dataset NAME               wikipedia, dolma or mock (default: wikipedia; quick: mock)
#   --training-config NAME       fast or standard (default: standard; quick: fast)
#   --tensor-dir DIR             capture root; records go to DIR/<scheme>/ (default ./enhanced_tensor_logs)
#   --log-dir DIR                one log per scheme and the report (default ./runs/tensor_collection/<time>)
#   --nproc-per-node N           ranks per node (default: the model's)
#   --poll-interval S            seconds between progress lines (default 10)
#   --quiet                      training output only in the log files, not on the terminal
#   --dry-run                    print the commands, run nothing
#   -h, --help                   this text
#
# Examples:
#   ./run_tensor_collection.sh single FA_linear_mxfp8
#   ./run_tensor_collection.sh --mode single --quant-scheme mxfp8 --control-iter 3 --collect-micro-batches 2
#   ./run_tensor_collection.sh batch bf16 FA_mxfp8 linear_mxfp8
#   ./run_tensor_collection.sh quick hifp8
#
# Environment: PYTHON (default: the repository's .venv if present, else python3).
# Exit status: 0 if every run succeeded and wrote records, 1 if one failed, 2 on a usage error,
# 130 when interrupted.

set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TAG="[collect]"

usage() {
    sed -n '2,/^set -euo pipefail/p' "${BASH_SOURCE[0]}" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
}

die() {  # usage error: one line, exit 2
    echo "run_tensor_collection.sh: error: $*" >&2
    exit 2
}

need_value() {
    [[ $# -ge 2 && -n $2 && $2 != --* ]] || die "$1 needs a value (see --help)"
}

need_int() {  # need_int FLAG VALUE MIN
    [[ $2 =~ ^[0-9]+$ ]] && (( $2 >= $3 )) || die "$1 '$2' must be an integer >= $3"
}

if [[ -z ${PYTHON:-} ]]; then
    if [[ -x ${SCRIPT_DIR}/.venv/bin/python ]]; then PYTHON=${SCRIPT_DIR}/.venv/bin/python; else PYTHON=python3; fi
fi
TRAIN_CONFIG="${SCRIPT_DIR}/train_config.py"
MODES="single batch quick"

MODE=""
QUANT_SCHEMES=()
CONTROL_ITER=1
COLLECT_MICRO_BATCHES=1
MODEL=""
DATASET=""
TRAINING_CONFIG=""
TENSOR_DIR=./enhanced_tensor_logs
LOG_DIR=""
NPROC=""
POLL_INTERVAL=10
QUIET=0
DRY_RUN=0
EXTRA_ARGS=()

while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --mode) need_value "$@"; MODE=$2; shift 2 ;;
        --quant-scheme|--quant-schemes|--quant-type|--quant-types)
            need_value "$@"; IFS=',' read -r -a _schemes <<< "$2"; QUANT_SCHEMES+=("${_schemes[@]}"); shift 2 ;;
        --control-iter) need_value "$@"; need_int "$1" "$2" 0; CONTROL_ITER=$2; shift 2 ;;
        --collect-micro-batches) need_value "$@"; need_int "$1" "$2" 1; COLLECT_MICRO_BATCHES=$2; shift 2 ;;
        --model) need_value "$@"; MODEL=$2; shift 2 ;;
        --dataset) need_value "$@"; DATASET=$2; shift 2 ;;
        --training-config) need_value "$@"; TRAINING_CONFIG=$2; shift 2 ;;
        --tensor-dir) need_value "$@"; TENSOR_DIR=$2; shift 2 ;;
        --log-dir) need_value "$@"; LOG_DIR=$2; shift 2 ;;
        --nproc-per-node) need_value "$@"; need_int "$1" "$2" 1; NPROC=$2; shift 2 ;;
        --poll-interval) need_value "$@"; need_int "$1" "$2" 1; POLL_INTERVAL=$2; shift 2 ;;
        --quiet) QUIET=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --) shift; EXTRA_ARGS=("$@"); break ;;
        -*) die "unknown option '$1' (see --help)" ;;
        *)
            if [[ -z $MODE ]]; then MODE=$1; else QUANT_SCHEMES+=("$1"); fi
            shift
            ;;
    esac
done

MODE=${MODE:-single}
case $MODE in
    single|batch|quick) ;;
    *) die "unknown mode '$MODE'; valid: ${MODES// /, }" ;;
esac

# ---------------------------------------------------------------------------------------------
# Defaults that depend on the mode and the machine.
# ---------------------------------------------------------------------------------------------
have_gpu() {
    command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L 2> /dev/null | grep -q '^GPU'
}
if [[ $MODE == quick ]]; then
    MODEL=${MODEL:-llama-tiny}
    DATASET=${DATASET:-mock}
    TRAINING_CONFIG=${TRAINING_CONFIG:-fast}
else
    if [[ -z $MODEL ]]; then
        if have_gpu; then MODEL=llama32-1b; else
            MODEL=llama-tiny
            echo "$TAG no GPU found: using --model llama-tiny (pass --model to choose)"
        fi
    fi
    DATASET=${DATASET:-wikipedia}
    TRAINING_CONFIG=${TRAINING_CONFIG:-standard}
fi
LOG_DIR=${LOG_DIR:-./runs/tensor_collection/$(date +%Y%m%d_%H%M%S)}

if [[ ${#QUANT_SCHEMES[@]} -eq 0 ]]; then
    if [[ $MODE == batch ]]; then QUANT_SCHEMES=(all); else QUANT_SCHEMES=(FA_linear_mxfp8); fi
fi

train_command() {  # train_command SCHEME[,SCHEME...] [train_config.py flags] -> the command in CMD
    local schemes=$1
    shift
    CMD=("$PYTHON" "$TRAIN_CONFIG" "$@" --model "$MODEL" --dataset "$DATASET" --quant-scheme "$schemes"
         --training-config "$TRAINING_CONFIG" --no-checkpoints
         --tensorboard-dir "$LOG_DIR/tensorboard/{scheme}"
         --save-tensors --tensor-save-dir "$TENSOR_DIR" --control-iter "$CONTROL_ITER"
         --collect-micro-batches "$COLLECT_MICRO_BATCHES")
    if [[ -n $NPROC ]]; then CMD+=(--nproc-per-node "$NPROC"); fi
    if [[ ${#EXTRA_ARGS[@]} -gt 0 ]]; then CMD+=(-- "${EXTRA_ARGS[@]}"); fi
    return 0
}

# One check of the whole configuration before anything starts: train_config.py validates every
# name against the experiment matrix (and, unless this is a dry run, that the data exists) and
# prints the canonical scheme of each run, one per line.
# Usage errors first, before any data or environment check.
if [[ $MODE != batch && ( ${#QUANT_SCHEMES[@]} -gt 1 || ${QUANT_SCHEMES[0]:-} == *,* ||
      ${QUANT_SCHEMES[0]:-} == all ) ]]; then
    die "mode $MODE collects one quant type, got ${QUANT_SCHEMES[*]}; use batch"
fi
ERR_FILE=$(mktemp)
trap 'rm -f "$ERR_FILE"' EXIT
REQUESTED=$(IFS=,; echo "${QUANT_SCHEMES[*]}")
if [[ $DRY_RUN == 1 ]]; then
    train_command "$REQUESTED" --print-schemes           # missing data: a note
else
    train_command "$REQUESTED" --print-schemes --check   # missing data: an error
fi
if ! RESOLVED=$("${CMD[@]}" 2> "$ERR_FILE"); then
    sed -e 's/^train_config.py: error: /run_tensor_collection.sh: error: /' \
        -e 's/ (see --help)$//' "$ERR_FILE" >&2
    exit 2
fi
sed -e "s/^\[train_config\] note: quantization /$TAG quant type /" "$ERR_FILE"
mapfile -t RUN_SCHEMES <<< "$RESOLVED"
[[ -n ${RUN_SCHEMES[0]:-} ]] || die "no quantization scheme to collect"
if [[ $MODE != batch && ${#RUN_SCHEMES[@]} -gt 1 ]]; then
    die "mode $MODE collects one quant type, got ${#RUN_SCHEMES[@]} (${RUN_SCHEMES[*]}); use batch"
fi

echo "$TAG mode $MODE: ${#RUN_SCHEMES[@]} run(s) of $MODEL on $DATASET ($TRAINING_CONFIG config)," \
     "control-iter $CONTROL_ITER, micro-batches $COLLECT_MICRO_BATCHES"
echo "$TAG tensors: $TENSOR_DIR/<scheme>/   logs: $LOG_DIR"

if [[ $DRY_RUN == 1 ]]; then
    # Each run's train_config.py command, then the torchrun command it would start.
    for s in "${RUN_SCHEMES[@]}"; do
        train_command "$s"
        echo "$TAG [$s] $(printf '%q ' "${CMD[@]}")"
        train_command "$s" --dry-run
        if ! "${CMD[@]}" 2> "$ERR_FILE"; then
            cat "$ERR_FILE" >&2
            exit 1
        fi
    done
    exit 0
fi
mkdir -p "$LOG_DIR" "$TENSOR_DIR"

# ---------------------------------------------------------------------------------------------
# Progress: records and bytes of the manifests a run creates under its scheme directory (files
# that were there before the run do not count), and the errors its summary files report.
# ---------------------------------------------------------------------------------------------
progress() {  # progress snapshot|count|errors|human ...: megatron.tensor_capture.progress
    PYTHONPATH="$SCRIPT_DIR${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m megatron.tensor_capture.progress "$@"
}

RUN_PID=""
INTERRUPTED=0
on_signal() {
    INTERRUPTED=1
    if [[ -n $RUN_PID ]] && kill -0 "$RUN_PID" 2> /dev/null; then
        echo "$TAG interrupted: stopping the run (pid $RUN_PID)" >&2
        kill -TERM "$RUN_PID" 2> /dev/null || true
    fi
}
trap on_signal INT TERM

REPORT_ROWS=()
FAILED=0
for s in "${RUN_SCHEMES[@]}"; do
    if [[ $INTERRUPTED == 1 ]]; then break; fi
    scheme_dir="$TENSOR_DIR/$s"
    log="$LOG_DIR/$s.log"
    baseline="$LOG_DIR/.$s.manifests-before"
    progress snapshot "$scheme_dir" > "$baseline"
    train_command "$s"
    echo "$TAG [$s] starting; log: $log"
    start=$(date +%s)
    if [[ $QUIET == 1 ]]; then
        "${CMD[@]}" > "$log" 2>&1 &
    else
        "${CMD[@]}" > >(tee "$log") 2>&1 &
    fi
    RUN_PID=$!
    last=$start
    while kill -0 "$RUN_PID" 2> /dev/null; do
        sleep 1
        now=$(date +%s)
        if (( now - last >= POLL_INTERVAL )); then
            read -r records bytes human < <(progress count "$scheme_dir" --since "$baseline")
            echo "$TAG [$s] $records records, $human, $((now - start)) s"
            last=$now
        fi
    done
    rc=0
    wait "$RUN_PID" || rc=$?
    RUN_PID=""
    seconds=$(( $(date +%s) - start ))
    sleep 0.2  # let tee flush the end of the log
    read -r records bytes human < <(progress count "$scheme_dir" --since "$baseline")
    errors=$(progress errors "$scheme_dir" --since "$baseline")
    if [[ $INTERRUPTED == 1 ]]; then
        status="interrupted"; FAILED=1
    elif [[ $rc -ne 0 ]]; then
        status="failed"; FAILED=1
    elif [[ -n $errors ]]; then
        status="capture-error"; FAILED=1
        echo "$TAG [$s] capture error: $errors" >&2
    elif [[ $records -eq 0 ]]; then
        status="no-records"; FAILED=1
        echo "$TAG [$s] the run succeeded but wrote no records to $scheme_dir" >&2
    else
        status="ok"
    fi
    echo "$TAG [$s] $status: $records records, $human, $seconds s"
    REPORT_ROWS+=("$s|$status|$rc|$records|$bytes|$seconds|$log")
    rm -f "$baseline"
done

# ---------------------------------------------------------------------------------------------
# Collection report (also written to LOG_DIR/report.txt and LOG_DIR/report.tsv).
# ---------------------------------------------------------------------------------------------
{
    echo "================================ tensor collection report ================================"
    echo "model $MODEL, dataset $DATASET, config $TRAINING_CONFIG, control-iter $CONTROL_ITER, micro-batches $COLLECT_MICRO_BATCHES"
    printf '%-16s %-14s %4s %9s %11s %8s  %s\n' "quant type" "status" "exit" "records" "bytes" "seconds" "log"
    for row in "${REPORT_ROWS[@]}"; do
        IFS='|' read -r s status rc records bytes seconds log <<< "$row"
        printf '%-16s %-14s %4d %9d %11s %8d  %s\n' "$s" "$status" "$rc" "$records" "$(progress human "$bytes")" "$seconds" "$log"
    done
    for s in "${RUN_SCHEMES[@]:${#REPORT_ROWS[@]}}"; do
        printf '%-16s %-14s\n' "$s" "not-run"
    done
    echo "tensors: $TENSOR_DIR"
} | tee "$LOG_DIR/report.txt"
{
    printf 'quant_type\tstatus\texit\trecords\tbytes\tseconds\tlog\n'
    for row in "${REPORT_ROWS[@]}"; do printf '%s\n' "${row//|/$'\t'}"; done
} > "$LOG_DIR/report.tsv"

if [[ $INTERRUPTED == 1 ]]; then exit 130; fi
exit "$FAILED"
