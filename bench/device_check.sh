#!/usr/bin/env bash
# The checks that need a GPU, in one go on a lent machine (~15 minutes of device time per issue, start-up
# included, so this is sized to end within ~7 minutes and leave room for a second run).
#
#   bench/device_check.sh [OUTDIR] [SECTIONS]   SECTIONS: comma-separated of tests,wn18rr,generated (default),
#                                               sweep (WN18RR recipe variants in parallel, valid split only)
#                                               and elastic (torchrun groups on the card: warm spares, kills)
#
# The sweep's variants: SWEEP (lines "label override=value ...") or SWEEP_FILE (a file of such lines; blank lines
# and lines starting with # are skipped), e.g. SWEEP_FILE=bench/sweeps/wn18rr_dura.txt. Its other knobs:
# SWEEP_EPOCHS (30), SWEEP_EVERY (score every so many epochs, 5), SWEEP_TIMEOUT (seconds per variant, 200),
# SWEEP_DEVICE (cuda; cpu checks the section end to end without a GPU), WN18RR_DATA (.devdata/wn18rr) and
# SWEEP_WORK (/tmp/wn18rr, the imported graph and checkpoints). A variant the config refuses fails in its first
# second: its error is in sweep.log.
#
# It runs from the repository root with PYTHONPATH (no install: the device image already has torch, numpy, h5py,
# pyyaml, pyarrow, fsspec, flatbuffers, tqdm, pytest, hypothesis, psutil, pytest-xdist). WN18RR is read from
# .devdata/wn18rr (a copy of ../shared/data/wn18rr, which does not travel; .git/info/exclude ignores .devdata).
# Each section has its own time limit and writes its log into OUTDIR, so one slow section cannot eat the others.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-/tmp/device-check}}
SECTIONS=${2:-tests,wn18rr,generated}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BIGGRAPH_NATIVE_CACHE=/tmp/biggraph-native
want() { [[ ",$SECTIONS," == *",$1,"* ]]; }

{
  date -u '+%Y-%m-%d %H:%M UTC'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
  nproc
} 2>&1 | tee "$OUTDIR/card.txt"

if want tests; then
  # the training suites on the GPU (helpers_graphs / test_fused read BIGGRAPH_TEST_DEVICE), plus the CUDA-only tests
  BIGGRAPH_TEST_DEVICE=cuda timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 240 -m "not slow" \
    tests/test_train_*.py tests/test_fused*.py tests/test_compute_dtype.py tests/test_regularizers.py \
    tests/test_checkpoint_manager.py tests/test_quality_options.py tests/test_validation.py 2>&1 | tail -40 | tee "$OUTDIR/tests.log"
  timeout ${CUDA_TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider --timeout 200 tests/test_cuda.py 2>&1 | tail -30 \
    | tee "$OUTDIR/test_cuda.log"
fi

if want wn18rr; then
  # the quality recipe's convergence, free of the 2-vCPU machine's speed: valid MRR every 5 epochs
  timeout 240 python3 bench/wn18rr_bench.py --data .devdata/wn18rr --work /tmp/wn18rr --epochs 40 --every 5 \
    --label cuda-auto -p device=cuda 2>&1 | tee "$OUTDIR/wn18rr.log"
fi

if want generated; then
  # the generated 1M-entity / 10M-edge graph at P=1 and P=4: compare with bench/RESULTS.md "Training on a GPU"
  timeout 240 python3 bench/train_bench.py --generated --edges 10000000 --entities 1000000 --partitions 1,4 \
    --devices cuda --no-pbg 2>&1 | tail -30 | tee "$OUTDIR/generated.log"
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
date -u '+%H:%M:%S done' | tee -a "$OUTDIR/card.txt"
