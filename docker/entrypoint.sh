#!/usr/bin/env bash
# biggraph container entrypoint: `torchrun ARGS` with health logging.
#
#   entrypoint.sh --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=c10d ... -m job train CONFIG
#   entrypoint.sh biggraph status ...      (a first argument that is not an option is exec'd as is)
#
# Logs one line at start (host, completion index, rendezvous), one at exit (exit code, duration).
# Environment:
#   JOB_COMPLETION_INDEX       set by Kubernetes for Indexed Jobs (the pod's replica number)
#   BIGGRAPH_RDZV_HOST_INDEX   the index that hosts the c10d rendezvous store: that pod gets
#                              is_host=true in --rdzv-conf, the others is_host=false (torchrun's own
#                              guess compares DNS answers, which lag while the headless Service fills)
#   BIGGRAPH_CONFIG            config to check before torchrun starts (`biggraph preflight`): a bad
#                              config exits 2 at once, which the Job's podFailurePolicy treats as fatal.
#                              Set (a pod of the chart) and the command `-m job train ...`: whether
#                              training is already complete is asked too (`biggraph completed` with
#                              train's arguments), before torchrun and again when torchrun fails; when
#                              it is, the pod exits 0 at once. A pod that comes back after the others
#                              finished (replaced, thawed) cannot rendezvous any more: the rendezvous
#                              host exited with them, and retrying would only fail the Job's index.
#   BIGGRAPH_TORCHRUN          the launcher (default: `python -m job.train.elastic.agent`, torchrun with a node that the
#                              c10d rendezvous dropped while its store stalled readmitted: job/train/elastic/agent.py)
set -uo pipefail

launcher="python -m job.train.elastic.agent"

log() { printf '%s biggraph-entrypoint: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >&2; }

if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    exec "$@"
fi

index=${JOB_COMPLETION_INDEX:-}
args=("$@")
is_host=""
if [ -n "${BIGGRAPH_RDZV_HOST_INDEX:-}" ] && [ -n "$index" ]; then
    if [ "$index" = "$BIGGRAPH_RDZV_HOST_INDEX" ]; then is_host=true; else is_host=false; fi
    merged=0
    for i in "${!args[@]}"; do
        case "${args[$i]}" in
            --rdzv-conf=*|--rdzv_conf=*)
                case "${args[$i]}" in *is_host=*) ;; *) args[i]="${args[$i]},is_host=$is_host" ;; esac
                merged=1 ;;
        esac
    done
    [ "$merged" = 1 ] || args=("--rdzv-conf=is_host=$is_host" "${args[@]}")
fi

# the command as logged: the value of any NAME=VALUE argument whose name says it is a credential (`-p
# storage_options.secret=...`, a token, a password, a key) is replaced, so that it never reaches the logs
redacted() {
    local arg out=()
    for arg in "$@"; do
        if [[ "$arg" == *=* ]] && [[ "${arg%%=*}" =~ [Ss][Ee][Cc][Rr][Ee][Tt]|[Pp][Aa][Ss][Ss]|[Tt][Oo][Kk][Ee][Nn]|[Kk][Ee][Yy]|[Cc][Rr][Ee][Dd][Ee][Nn][Tt][Ii][Aa][Ll] ]]; then
            arg="${arg%%=*}=<redacted>"
        fi
        out+=("$arg")
    done
    printf '%s' "${out[*]}"
}

log "start host=$(hostname) pod=${POD_NAME:-?} index=${index:-none} rdzv_host=${is_host:-auto} uid=$(id -u)" \
    "cmd=${BIGGRAPH_TORCHRUN:-$launcher} $(redacted "${args[@]}")"

if [ -n "${BIGGRAPH_CONFIG:-}" ] && [ "${BIGGRAPH_PREFLIGHT:-1}" != 0 ]; then
    python -m job preflight "$BIGGRAPH_CONFIG"
    rc=$?
    if [ "$rc" != 0 ]; then
        log "exit code=$rc reason=preflight config=$BIGGRAPH_CONFIG"
        exit "$rc"
    fi
fi

# train's arguments (CONFIG, -p overrides...) when torchrun is to run `-m job train`, for the completion check
train_args=()
checks_completion=0
if [ -n "${BIGGRAPH_CONFIG:-}" ]; then
    for i in "${!args[@]}"; do
        if [ "${args[$i]}" = "-m" ] && [ "${args[$((i + 1))]:-}" = job ] && [ "${args[$((i + 2))]:-}" = train ]; then
            train_args=("${args[@]:$((i + 3))}")
            checks_completion=1
            break
        fi
    done
fi

# `biggraph completed`: 0 complete (its one line is logged, the pod exits 0), 3 not complete, 2 bad input (exits
# 2: the podFailurePolicy's fatal code). Anything else is the check's own failure: torchrun decides then.
completed() {
    local when=$1 message rc
    message=$(python -m job completed "${train_args[@]}")
    rc=$?
    case "$rc" in
        0) log "exit code=0 reason=complete index=${index:-none} ($when): $message"; exit 0 ;;
        2) log "exit code=2 reason=completion-check index=${index:-none}"; exit 2 ;;
        3) [ "$when" = start ] || log "$message" ;;
        *) log "completion check failed (code $rc): going on" ;;
    esac
}
[ "$checks_completion" = 1 ] && completed start

started=$(date +%s)
${BIGGRAPH_TORCHRUN:-$launcher} "${args[@]}" &
child=$!
signalled=""
forward() { signalled=$1; log "signal $1: stopping torchrun (pid $child)"; kill -s "$1" "$child" 2>/dev/null; }
trap 'forward TERM' TERM
trap 'forward INT' INT
# wait returns early (>128) when a trapped signal arrives: keep waiting for torchrun itself
while true; do
    wait "$child"
    rc=$?
    kill -0 "$child" 2>/dev/null || break
done
# a failed agent (its rendezvous gone: the others finished while this pod waited or was frozen) may have nothing
# left to do; a pod being stopped (a forwarded signal) is not asked: the kubelet is waiting for it
if [ "$rc" != 0 ] && [ "$checks_completion" = 1 ] && [ -z "$signalled" ]; then
    completed "after torchrun exited $rc"
fi
# The failure budget's exit codes (docs/kubernetes.md): the chart's podFailurePolicy ignores 143 and 77, so each
# must mean only what it says. 143: this pod was stopped from outside (a forwarded SIGTERM: deleted, drained,
# scaled down). 77: the launcher found the rendezvous gone (job/train/elastic/agent.py) on a pod that does not host
# it, i.e. its host pod was lost; on the host itself (or with an external rendezvous) it is a failure like any other.
if [ -n "$signalled" ]; then
    rc=143
elif [ "$rc" = 143 ] || { [ "$rc" = 77 ] && [ "$is_host" != false ]; }; then
    rc=1
fi
log "exit code=$rc seconds=$(( $(date +%s) - started )) index=${index:-none}"
exit "$rc"
