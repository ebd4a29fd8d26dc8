#!/usr/bin/env bash
# The checks that need a GPU, in one go on a lent machine (~15 minutes of device time per issue, start-up
# included, so the default sections are sized to end within ~9 minutes: there is no time for a second run).
#
#   bench/device_check.sh [LOGDIR] [SECTIONS]      e.g. bash bench/device_check.sh /tmp/logs cuda
#
# SECTIONS, comma-separated (default: tests,generated,umls,freebase — issue #48's list), run in the order tests,
# freebase, generated, umls (the headline figure before the cheaper ones, in case the device's time runs out):
#   tests      tests/test_cuda.py (alone: cuda), and the training suites with BIGGRAPH_TEST_DEVICE=cuda (alone:
#              suites), side by side
#   generated  the generated 1M-entity / 10M-edge graph at P=1 and P=4: GPU against the CPU trainer on the
#              device's cores (16 Hogwild workers), compute and wall edges/s, one invocation
#   umls       UMLS filtered MRR and speed, 25 epochs: GPU float32, GPU bfloat16, CPU (16 workers)
#   freebase   a Freebase86m-size graph (86M entities, 338M edges, 14,824 relations; bench/freebase_like.py,
#              generated in the background while the tests run) trained for one epoch at P=1 on the card
#              (bench/gpu_epoch_bench.py: wall, pass, compute, peak card memory, the card's own rates);
#   freebase4  the same graph at P=4 (generated again, split in 4), one epoch: last, in whatever time is left
#   wn18rr, sweep, elastic   earlier issues' sections (see their comments below)
#
# The sweep's variants: SWEEP (lines "label override=value ...") or SWEEP_FILE (a file of such lines; blank lines
# and lines starting with # are skipped), e.g. SWEEP_FILE=bench/sweeps/wn18rr_dura.txt. Its other knobs:
# SWEEP_EPOCHS (30), SWEEP_EVERY (score every so many epochs, 5), SWEEP_TIMEOUT (seconds per variant, 200),
# SWEEP_DEVICE (cuda; cpu checks the section end to end without a GPU), WN18RR_DATA (.devdata/wn18rr) and
# SWEEP_WORK (/tmp/wn18rr, the imported graph and checkpoints). A variant the config refuses fails in its first
# second: its error is in sweep.log.
#
# It runs from the repository root with PYTHONPATH (no install: the device image already has torch, numpy, h5py,
# pyyaml, pyarrow, fsspec, flatbuffers, tqdm, pytest, hypothesis, psutil, pytest-xdist). Datasets are read from
# .devdata (the device cannot download): .devdata/datasets/umls (a copy of ~/.cache/biggraph/datasets/umls) and
# .devdata/wn18rr (of ../shared/data/wn18rr); .git/info/exclude ignores .devdata, so the run carries it.
# Each section has its own time limit and writes its log into OUTDIR, so one slow section cannot eat the others.
# Large files (the generated graphs, checkpoints) go under WORK (/tmp/device-work), never under OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
# logs go to OUTDIR; with $OUT set (the device tool's folder, which returns at most 8 files) they are packed into
# $OUT/device_logs.tgz after every section, so that a run cut short still returns what it did
OUTDIR=${1:-/tmp/device-check}
PACK=${OUT:-}
SECTIONS=${2:-tests,generated,umls,freebase,freebase4}
WORK=${WORK:-/tmp/device-work}
mkdir -p "$OUTDIR" "$WORK"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BIGGRAPH_NATIVE_CACHE=/tmp/biggraph-native
export BIGGRAPH_DATA_DIR=${BIGGRAPH_DATA_DIR:-$PWD/.devdata/datasets}
want() { [[ ",$SECTIONS," == *",$1,"* ]]; }
# DEADLINE_S (seconds from the start, default 540): a section's limit is the smaller of its own and what is left,
# so a slow section cannot push the last ones past the device call's limit
STARTED=$(date +%s)
limit() { local left=$(( ${DEADLINE_S:-540} - ($(date +%s) - STARTED) )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
stamp() {
  [[ -n "$PACK" ]] && tar czf "$PACK/device_logs.tgz" -C "$OUTDIR" . 2>/dev/null
  date -u "+%H:%M:%S $1" | tee -a "$OUTDIR/card.txt"
}

{
  date -u '+%Y-%m-%d %H:%M UTC'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
  nproc; free -g | head -2; df -h /tmp /dev/shm | tail -2
} 2>&1 | tee "$OUTDIR/card.txt"

FB_ENTITIES=${FB_ENTITIES:-86054151}
FB_EDGES=${FB_EDGES:-338586276}
FB_RELATIONS=${FB_RELATIONS:-14824}
GEN_PID=
# the Freebase-size checkpoint (~35 GB) in memory when /dev/shm has room: the disk's fsync is not what is measured
FB_CKPT=${FB_CKPT:-$WORK}
if [[ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')" -ge 50 ]] 2>/dev/null; then
  FB_CKPT=/dev/shm/biggraph
fi
mkdir -p "$FB_CKPT"
echo "freebase checkpoint under $FB_CKPT" >>"$OUTDIR/card.txt"
if want freebase; then
  # the CPU's work, while the GPU runs the tests: nothing timed runs beside it
  ( timeout "${FB_GEN_TIMEOUT:-240}" python3 bench/freebase_like.py --out "$WORK/fb_p1" --entities "$FB_ENTITIES" \
      --edges "$FB_EDGES" --relations "$FB_RELATIONS" --partitions 1 --threads "${FB_GEN_THREADS:-12}" \
      --checkpoint-path "$FB_CKPT/fb_p1_ckpt" >"$OUTDIR/fb_generate.log" 2>&1
    echo "exit $?" >>"$OUTDIR/fb_generate.log" ) &
  GEN_PID=$!
fi

if want tests || want suites || want cuda; then
  stamp "tests"
  SUITE_PID=
  if want tests || want suites; then
    # the training suites on the GPU (helpers_graphs / test_fused read BIGGRAPH_TEST_DEVICE) beside the CUDA-only tests
    BIGGRAPH_TEST_DEVICE=cuda timeout $(limit ${TESTS_TIMEOUT:-170}) python3 -m pytest -q -p no:cacheprovider -n 6 --timeout 160 \
      -m "not slow" tests/test_train_*.py tests/test_fused*.py tests/test_compute_dtype.py tests/test_regularizers.py \
      tests/test_checkpoint_manager.py tests/test_quality_options.py tests/test_validation.py \
      >"$OUTDIR/tests_full.log" 2>&1 &
    SUITE_PID=$!
  fi
  if want tests || want cuda; then
    timeout $(limit ${CUDA_TESTS_TIMEOUT:-170}) python3 -m pytest -q -p no:cacheprovider --timeout 160 -rA tests/test_cuda.py \
      >"$OUTDIR/test_cuda_full.log" 2>&1
    tail -60 "$OUTDIR/test_cuda_full.log" >"$OUTDIR/test_cuda.log"
  fi
  if [[ -n "$SUITE_PID" ]]; then
    wait $SUITE_PID
    tail -40 "$OUTDIR/tests_full.log" >"$OUTDIR/tests.log"
  fi
  grep -hE "passed|failed|error" "$OUTDIR"/tests.log "$OUTDIR"/test_cuda.log 2>/dev/null | tail -6
fi
if [[ -n "$GEN_PID" ]]; then
  stamp "waiting for the Freebase-size graph"
  wait $GEN_PID
  tail -5 "$OUTDIR/fb_generate.log"
fi

if want freebase; then
  stamp "freebase P=1"
  rm -rf "$FB_CKPT/fb_p1_ckpt"
  timeout $(limit ${FB_TIMEOUT:-200}) python3 bench/gpu_epoch_bench.py "$WORK/fb_p1/config.json" --label fb86m-p1 \
    --json "$OUTDIR/freebase.json" ${FB_PARAMS:-} >"$OUTDIR/freebase_full.log" 2>&1
  echo "exit $?" >>"$OUTDIR/freebase_full.log"
  tail -25 "$OUTDIR/freebase_full.log" | tee "$OUTDIR/freebase.log"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader >>"$OUTDIR/freebase.log" 2>&1
fi

if want generated; then
  stamp "generated"
  # the generated 1M-entity / 10M-edge graph at P=1 and P=4, the GPU against the CPU trainer on the same cores
  timeout $(limit ${GENERATED_TIMEOUT:-130}) python3 bench/train_bench.py --generated --edges 10000000 --entities 1000000 \
    --partitions 1,4 --workers 16 --devices cuda,cpu --no-pbg --work "$WORK/generated" 2>&1 | tail -30 \
    | tee "$OUTDIR/generated.log"
fi

if want umls; then
  stamp "umls"
  # quality on the GPU in float32 and bfloat16 against the CPU trainer, same epochs, same evaluator
  timeout $(limit ${UMLS_TIMEOUT:-90}) python3 bench/train_bench.py --datasets umls --epochs 25 --workers 16 \
    --devices cuda,cuda/bfloat16,cpu --no-pbg --work "$WORK/umls" 2>&1 | tail -12 | tee "$OUTDIR/umls.log"
fi

if want freebase4; then
  stamp "freebase P=4"
  rm -rf "$WORK/fb_p1" "$FB_CKPT/fb_p1_ckpt"
  timeout $(limit ${FB_P4_TIMEOUT:-300}) bash -c "python3 bench/freebase_like.py --out '$WORK/fb_p4' --entities $FB_ENTITIES \
    --edges $FB_EDGES --relations $FB_RELATIONS --partitions 4 --threads 16 --checkpoint-path '$FB_CKPT/fb_p4_ckpt' \
    && python3 bench/gpu_epoch_bench.py '$WORK/fb_p4/config.json' --label fb86m-p4 --no-card-facts \
    --json '$OUTDIR/freebase.json' ${FB_PARAMS:-}" >"$OUTDIR/freebase_p4_full.log" 2>&1
  tail -10 "$OUTDIR/freebase_p4_full.log" | tee "$OUTDIR/freebase_p4.log"
fi

if want wn18rr; then
  # the quality recipe's convergence, free of the 2-vCPU machine's speed: valid MRR every 5 epochs
  timeout 240 python3 bench/wn18rr_bench.py --data .devdata/wn18rr --work /tmp/wn18rr --epochs 40 --every 5 \
    --label cuda-auto -p device=cuda 2>&1 | tee "$OUTDIR/wn18rr.log"
fi

if want elastic; then
  # issue #30 on a GPU pod: trainers started from warm spares (job/train/elastic/spare.py) train on the card. test_cuda.py's
  # num_gpus=2 relaunch goes through the pods' launcher and asserts both trainers came from spares; the distributed
  # tests' kills, SIGTERMs, drains, additions and a replaced pod's rejoin run with every rank on the card
  # (BIGGRAPH_TEST_DEVICE reaches tests/helpers_distributed.py's UMLS config; the two-namespace test needs root and
  # iproute2, left out); then a group's start-up, spares against cold trainers, CUDA's initialisation included.
  if ! want tests; then  # the tests section ran it already
    timeout ${CUDA_TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider --timeout 200 tests/test_cuda.py 2>&1 \
      | tail -30 | tee "$OUTDIR/test_cuda.log"
  fi
  # UMLS from .devdata/datasets/umls (a copy of ~/.cache/biggraph/datasets/umls: the device cannot download it)
  BIGGRAPH_DATA_DIR=$PWD/.devdata/datasets BIGGRAPH_TEST_DEVICE=cuda timeout ${ELASTIC_TIMEOUT:-300} \
    python3 -m pytest -q -p no:cacheprovider -n 4 --timeout 280 -m slow -k "not namespaces" \
    tests/test_distributed.py tests/test_elastic_rounds.py 2>&1 | tail -40 | tee "$OUTDIR/elastic_tests.log"
  timeout ${STARTUP_TIMEOUT:-200} python3 bench/group_startup_bench.py --ranks 2 --device cuda --cold --repeats 3 \
    --json "$OUTDIR/startup.json" 2>&1 | tail -12 | tee "$OUTDIR/startup.log"
fi

if want sweep; then
  # recipe variants of `preset: quality` (ComplEx, d=256) side by side on the one GPU, scored on valid only
  # (tune on valid: issue #33); each line of SWEEP is "label override...". The GPU frees the comparison from the
  # 2-vCPU machine's speed: what a recipe reaches when epochs are cheap.
  WN18RR_DATA=${WN18RR_DATA:-.devdata/wn18rr}
  SWEEP_WORK=${SWEEP_WORK:-/tmp/wn18rr}
  PY=${PYTHON:-python3}
  mkdir -p "$SWEEP_WORK"
  [[ -e "$SWEEP_WORK/data/test" ]] || "$PY" -c "import sys; sys.path[:0] = ['bench', '.']; from pathlib import Path
from train_bench import import_kg; import_kg(sys.argv[1], Path(sys.argv[2]))" "$WN18RR_DATA" "$SWEEP_WORK" >/dev/null 2>&1
  if [[ -n "${SWEEP_FILE:-}" ]]; then
    SWEEP=$(grep -vE '^[[:space:]]*(#|$)' "$SWEEP_FILE")
  fi
  SWEEP=${SWEEP:-"f32 compute_dtype=float32
n3e01 regularization_coef=0.01
n3e03 regularization_coef=0.03
n3e1 regularization_coef=0.1
n3s03 regularizer=N3_shared_relations regularization_coef=0.03
n3s1 regularizer=N3_shared_relations regularization_coef=0.1
lr01 lr=0.1
n3e03lr01 regularization_coef=0.03 lr=0.1"}
  rm -f "$SWEEP_WORK"/sweep_*.log
  while read -r label overrides; do
    [[ -n "$label" ]] || continue
    params=(-p "device=${SWEEP_DEVICE:-cuda}")
    for item in $overrides; do params+=(-p "$item"); done
    OMP_NUM_THREADS=2 timeout "${SWEEP_TIMEOUT:-200}" "$PY" bench/wn18rr_bench.py --data "$WN18RR_DATA" \
      --work "$SWEEP_WORK" --epochs "${SWEEP_EPOCHS:-30}" --every "${SWEEP_EVERY:-5}" --label "$label" "${params[@]}" \
      >"$SWEEP_WORK/sweep_$label.log" 2>&1 &
  done <<<"$SWEEP"
  wait
  grep -h '^{' "$SWEEP_WORK"/sweep_*.log | grep -v product_gflops | tee "$OUTDIR/sweep.log"
  # a variant that failed: the trainer's own log holds the reason (wn18rr_bench keeps it beside the checkpoints)
  for log in "$SWEEP_WORK"/sweep_*.log; do
    label=$(basename "$log" .log); label=${label#sweep_}
    if ! grep -q '"valid"' "$log"; then
      echo "== $label: no valid score" | tee -a "$OUTDIR/sweep.log"
      tail -n 8 "$log" "$SWEEP_WORK/$label.log" 2>/dev/null | tee -a "$OUTDIR/sweep.log"
    fi
  done
fi
stamp "done"
[[ -n "$PACK" ]] && tar czf "$PACK/device_logs.tgz" -C "$OUTDIR" . 2>/dev/null
true
