#!/bin/bash
# Collect tensors, visualise them, or both.
#
# Usage:
#   ./run_tensor_draw.sh [MODE] [QUANT_SCHEME ...] [options] [-- tensor_visualizer.py flags]
#
# Modes:
#   visualize  analyse the captures in --tensor-dir with tools/visualization/tensor_visualizer.py
#              (plots, statistics and report.html in --output-dir); the default
#   collect    collect tensors with run_tensor_collection.sh
#   both       collect, then visualise everything in --tensor-dir
#
# Options:
#   --mode MODE                  visualize, collect or both (instead of the positional MODE)
#   --tensor-dir DIR             capture root (default ./enhanced_tensor_logs); in visualize mode
#                                it may be absent when loss logs or telemetry are given
#   --output-dir DIR             visualisation output (default ./runs/draw/<time>)
#   --loss-dir DIR               training logs named by scheme (bf16.log, ...; *-capture.log
#                                are left out), e.g. runs/demo/logs; may be repeated
#   --loss-logs NAME=PATH        one training log or TensorBoard directory per run; may be
#                                repeated
#   --tensorboard-dir DIR        quantization telemetry (--quant-stats-interval): a TensorBoard
#                                directory or a parent with one per scheme (runs/demo/tensorboard)
# Collection options (collect, both), passed to run_tensor_collection.sh:
#   --collect-mode MODE          single, batch or quick (default: single for one quant scheme,
#                                batch for several)
#   --quant-scheme S[,S...]      scheme(s) to collect (default FA_linear_mxfp8); may be repeated
#                                (--quant-type, the original name, does the same)
#   --control-iter N, --collect-micro-batches M, --model NAME, --dataset NAME,
#   --training-config NAME, --nproc-per-node N, --log-dir DIR, --poll-interval S, --quiet
#                                as in run_tensor_collection.sh --help; with both, the
#                                training logs of the collection become the report's loss curves
# Flags after -- go to tensor_visualizer.py (e.g. -- --max-records 50 --workers 1).
#   --dry-run                    print what would run, run nothing
#   -h, --help                   this text
#
# Examples:
#   ./run_tensor_draw.sh visualize --tensor-dir ./enhanced_tensor_logs --output-dir runs/draw/mine
#   ./run_tensor_draw.sh visualize --loss-dir runs/demo/logs --tensorboard-dir runs/demo/tensorboard
#   ./run_tensor_draw.sh both mxfp8
#   ./run_tensor_draw.sh --mode both --quant-scheme FA_linear_mxfp8 --control-iter 3 --collect-micro-batches 2
#   ./run_tensor_draw.sh both --collect-mode quick --tensor-dir /tmp/t --output-dir /tmp/draw
#
# Environment: PYTHON (default: the repository's .venv if present, else python3).
# Exit status: 0 on success, 1 if collection or visualisation failed, 2 on a usage error,
# 130 when interrupted.

set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TAG="[draw]"

usage() {
    sed -n '2,/^set -euo pipefail/p' "${BASH_SOURCE[0]}" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
}

die() {
    echo "run_tensor_draw.sh: error: $*" >&2
    exit 2
}

need_value() {
    [[ $# -ge 2 && -n $2 && $2 != --* ]] || die "$1 needs a value (see --help)"
}

if [[ -z ${PYTHON:-} ]]; then
    if [[ -x ${SCRIPT_DIR}/.venv/bin/python ]]; then PYTHON=${SCRIPT_DIR}/.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHON
COLLECTOR="${SCRIPT_DIR}/run_tensor_collection.sh"
VISUALIZER="${SCRIPT_DIR}/tools/visualization/tensor_visualizer.py"

MODE=""
TENSOR_DIR=./enhanced_tensor_logs
TENSOR_DIR_GIVEN=0
SOURCE_ARGS=()              # --loss-dir / --loss-logs / --tensorboard-dir for the visualiser
OUTPUT_DIR=""
COLLECT_MODE=""
QUANT_SCHEMES=()
COLLECT_ARGS=()
LOG_DIR=""
VIS_ARGS=()
DRY_RUN=0

while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --mode) need_value "$@"; MODE=$2; shift 2 ;;
        --tensor-dir) need_value "$@"; TENSOR_DIR=$2; TENSOR_DIR_GIVEN=1; shift 2 ;;
        --loss-dir|--loss-logs|--tensorboard-dir)
            need_value "$@"; SOURCE_ARGS+=("$1" "$2"); shift 2 ;;
        --output-dir) need_value "$@"; OUTPUT_DIR=$2; shift 2 ;;
        --collect-mode) need_value "$@"; COLLECT_MODE=$2; shift 2 ;;
        --quant-scheme|--quant-schemes|--quant-type|--quant-types)
            need_value "$@"; IFS=',' read -r -a _schemes <<< "$2"; QUANT_SCHEMES+=("${_schemes[@]}"); shift 2 ;;
        --log-dir) need_value "$@"; LOG_DIR=$2; shift 2 ;;
        --control-iter|--collect-micro-batches|--model|--dataset|--training-config|--nproc-per-node|--poll-interval)
            need_value "$@"; COLLECT_ARGS+=("$1" "$2"); shift 2 ;;
        --quiet) COLLECT_ARGS+=("$1"); shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --) shift; VIS_ARGS=("$@"); break ;;
        -*) die "unknown option '$1' (see --help)" ;;
        *)
            if [[ -z $MODE ]]; then MODE=$1; else QUANT_SCHEMES+=("$1"); fi
            shift
            ;;
    esac
done

MODE=${MODE:-visualize}
case $MODE in
    visualize|collect|both) ;;
    *) die "unknown mode '$MODE'; valid: visualize, collect, both" ;;
esac
if [[ $MODE == visualize && ( ${#QUANT_SCHEMES[@]} -gt 0 || ${#COLLECT_ARGS[@]} -gt 0 || -n $COLLECT_MODE || -n $LOG_DIR ) ]]; then
    die "quant types and collection options need mode collect or both, not visualize"
fi
if [[ -z $COLLECT_MODE ]]; then
    if [[ ${#QUANT_SCHEMES[@]} -gt 1 ]]; then COLLECT_MODE=batch; else COLLECT_MODE=single; fi
fi
case $COLLECT_MODE in
    single|batch|quick) ;;
    *) die "unknown --collect-mode '$COLLECT_MODE'; valid: single, batch, quick" ;;
esac
LOG_DIR=${LOG_DIR:-./runs/tensor_collection/$(date +%Y%m%d_%H%M%S)}
# Under runs/ (ignored by git), like the collection's logs: never a ./draw beside the sources.
OUTPUT_DIR=${OUTPUT_DIR:-./runs/draw/$(date +%Y%m%d_%H%M%S)}
LOSS_ARGS=()

collect() {
    local cmd=(bash "$COLLECTOR" --mode "$COLLECT_MODE" --tensor-dir "$TENSOR_DIR" --log-dir "$LOG_DIR")
    local s
    for s in "${QUANT_SCHEMES[@]}"; do cmd+=(--quant-scheme "$s"); done
    if [[ ${#COLLECT_ARGS[@]} -gt 0 ]]; then cmd+=("${COLLECT_ARGS[@]}"); fi
    if [[ $DRY_RUN == 1 ]]; then cmd+=(--dry-run); fi
    echo "$TAG collecting: $(printf '%q ' "${cmd[@]}")"
    "${cmd[@]}"
}

loss_logs_of_collection() {  # --loss-logs SCHEME=LOG for each run of this collection
    local report="$LOG_DIR/report.tsv" s status rc records bytes seconds log
    [[ -f $report ]] || return 0
    while IFS=$'\t' read -r s status rc records bytes seconds log; do
        if [[ $s != quant_type && -f $log ]]; then LOSS_ARGS+=("$s=$log"); fi
    done < "$report"
    if [[ ${#LOSS_ARGS[@]} -gt 0 ]]; then LOSS_ARGS=(--loss-logs "${LOSS_ARGS[@]}"); fi
}

visualize() {
    local cmd=("$PYTHON" "$VISUALIZER" --output-dir "$OUTPUT_DIR")
    # Loss logs and telemetry can be compared without any capture: the default tensor
    # directory is then simply left out when it does not exist.
    local with_captures=1
    if [[ ${#SOURCE_ARGS[@]} -gt 0 && $TENSOR_DIR_GIVEN == 0 && ! -d $TENSOR_DIR ]]; then
        with_captures=0
        echo "$TAG no capture directory $TENSOR_DIR: comparing the loss logs / telemetry only"
    fi
    if [[ $with_captures == 1 ]]; then cmd+=(--tensor-dir "$TENSOR_DIR"); fi
    if [[ ${#SOURCE_ARGS[@]} -gt 0 ]]; then cmd+=("${SOURCE_ARGS[@]}"); fi
    if [[ ${#LOSS_ARGS[@]} -gt 0 ]]; then cmd+=("${LOSS_ARGS[@]}"); fi
    if [[ ${#VIS_ARGS[@]} -gt 0 ]]; then cmd+=("${VIS_ARGS[@]}"); fi
    echo "$TAG visualizing: $(printf '%q ' "${cmd[@]}")"
    if [[ $DRY_RUN == 1 ]]; then return 0; fi
    if [[ ! -f $VISUALIZER ]]; then
        echo "run_tensor_draw.sh: error: the visualiser $VISUALIZER is not installed" >&2
        return 1
    fi
    if [[ $with_captures == 1 && ! -d $TENSOR_DIR ]]; then
        echo "run_tensor_draw.sh: error: tensor directory $TENSOR_DIR not found; collect first" \
             "(./run_tensor_draw.sh both, or ./run_tensor_collection.sh), or give --loss-dir /" \
             "--tensorboard-dir to compare runs without captures" >&2
        return 1
    fi
    mkdir -p "$OUTPUT_DIR"
    local rc=0
    "${cmd[@]}" || rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "run_tensor_draw.sh: error: the visualiser failed (exit $rc)" >&2
        return 1
    fi
    if [[ -f $OUTPUT_DIR/report.html ]]; then
        echo "$TAG report: $(cd "$OUTPUT_DIR" && pwd)/report.html"
    else
        echo "run_tensor_draw.sh: error: the visualiser wrote no report.html in $OUTPUT_DIR" >&2
        return 1
    fi
}

STATUS=0
if [[ $MODE == collect || $MODE == both ]]; then
    rc=0
    collect || rc=$?
    case $rc in
        0) ;;
        2|130) exit "$rc" ;;          # usage error or interrupted: stop here
        *)
            STATUS=1
            echo "$TAG collection reported a failure (exit $rc); see its report above" >&2
            ;;
    esac
fi
if [[ $MODE == visualize || $MODE == both ]]; then
    if [[ $MODE == both ]]; then loss_logs_of_collection; fi
    visualize || STATUS=1
fi
exit "$STATUS"
