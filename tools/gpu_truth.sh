#!/usr/bin/env bash
# The GPU truth kit: proves the course on a GPU machine over the torch that machine already has, offline.
#
#   tools/gpu_truth.sh [--dry] STAGE...     stages, run in the order given (each well under 10 minutes):
#     setup      a venv with --system-site-packages over the machine's Python (its torch), the wheelhouse
#                (make gpu-kit, .gpu-kit/wheels) installed offline, labsrc from this checkout, the "labsrc" kernel
#     doctor     python -m labsrc.doctor --json
#     probe      the device's measured ceilings: device-to-device copy bandwidth, bf16 and tf32 matrix products
#     tests      the GPU unit tests (GPU_TESTS)
#     notebooks  every notebook under nbmake in NB_PROFILE (default ci: the course's CI sizes, on the GPU);
#                NB_FILTER picks notebooks (shell globs under notebooks/), NB_JOBS runs them side by side
#     bench      python -m labsrc.bench over BENCH_SET (headline: ResNet-18 and ResNet-50 in fp32, tf32, bf16,
#                fp16; bf16 channels_last; bf16 channels_last compiled)
#     capstone   the capstone lab in the gpu profile on synthetic CIFAR-sized data (CAPSTONE_ARGS: its flags)
#     report     one JSON and a Markdown table (tools/gpu_truth_report.py) under REPORT_DIR
#     pack       the work folder (logs, junit XML, bench JSONs) as one archive under $OUT
#   STAGE_LIMIT (default 570 s) bounds each stage (SIGINT, then SIGKILL 30 s later).
#   --dry: the rehearsal on a machine without a GPU (tests/test_gpu_kit.py): the same stages at CPU sizes.
#
# Everything a stage writes goes to GPU_TRUTH_WORK (default runs/gpu-truth); stages.jsonl there records each
# stage's exit status and seconds. Environment: IMAGE_PYTHON (the machine's python, default python3), GPU_KIT
# (the wheelhouse folder, default .gpu-kit), GPU_TRUTH_VENV (default /tmp/labsrc-gpu-venv).
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
SELF=$REPO/tools/gpu_truth.sh
IMAGE_PYTHON=${IMAGE_PYTHON:-python3}
KIT=${GPU_KIT:-$REPO/.gpu-kit}
VENV=${GPU_TRUTH_VENV:-/tmp/labsrc-gpu-venv}
WORK=${GPU_TRUTH_WORK:-$REPO/runs/gpu-truth}
PY=$VENV/bin/python
DRY=0
if [ "${1:-}" = "--dry" ]; then DRY=1; shift; fi
export DRY
if [ $# -eq 0 ]; then sed -n '2,20p' "$0"; exit 2; fi
cd "$REPO" || exit 2
shopt -s nullglob
export PYTHONNOUSERSITE=1  # nothing from ~/.local shadows the image's packages or the wheels
mkdir -p "$WORK/logs"
[ -e "$WORK/.started" ] || touch "$WORK/.started"
export MPLBACKEND=Agg LABSRC_HEADLESS=1 PYTHONUNBUFFERED=1

say() { echo "[gpu_truth $(date +%H:%M:%S)] $*"; }

stage_setup() {
  local wheels=$KIT/wheels
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    say "no wheels in $wheels: run 'make gpu-kit' on a machine with PyPI and carry .gpu-kit"; return 1
  fi
  rm -rf "$VENV"
  "$IMAGE_PYTHON" -m venv --without-pip --system-site-packages "$VENV" || return 1
  local site
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  # An image whose python3 is itself a venv (/opt/torch/.venv) gives a venv made from it the *base* Python's
  # packages, not its own: its own site-packages (torch), with the .pth files there, is then added as a site dir.
  if "$IMAGE_PYTHON" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    "$IMAGE_PYTHON" -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' \
        > "$site/_image_site.pth" || return 1
  fi
  "$IMAGE_PYTHON" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
      --target "$site" "$wheels"/*.whl || return 1
  echo "$REPO" > "$site/_labsrc_checkout.pth"   # labsrc from this checkout, as an editable install would
  "$PY" -m ipykernel install --sys-prefix --name labsrc --display-name "Python (labsrc course)" >/dev/null || return 1
  local image_torch
  image_torch=$("$IMAGE_PYTHON" -c 'import torch; print(torch.__file__)') || return 1
  "$PY" -c "import sys, torch; sys.exit(torch.__file__ != '$image_torch')" \
      || { say "the venv's torch is not the image's ($image_torch)"; return 1; }
  "$PY" - <<'PY'
import importlib, torch
for name in ("labsrc", "nbmake", "ipykernel", "ipywidgets", "matplotlib", "psutil", "torchvision"):
    importlib.import_module(name)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {torch.cuda.device_count()}")
PY
}

stage_doctor() { "$PY" -m labsrc.doctor --json > "$WORK/doctor.json" && "$PY" -m labsrc.doctor; }

stage_probe() { "$PY" "$REPO/tools/gpu_truth_probe.py" --out "$WORK/probe.json"; }

stage_tests() {
  local tests=${GPU_TESTS:-tests/test_gpu.py tests/test_mixed_precision.py tests/test_data_loading.py tests/test_bench.py}
  # shellcheck disable=SC2086
  (cd "$REPO" && LABSRC_PROFILE=ci "$PY" -m pytest $tests -q -p no:cacheprovider -o addopts= \
      --junitxml="$WORK/tests.xml")
}

stage_notebooks() {
  local profile=${NB_PROFILE:-ci} jobs=${NB_JOBS:-4} timeout=${NB_TIMEOUT:-600} files=() pattern
  for pattern in ${NB_FILTER:-*.ipynb}; do files+=(notebooks/$pattern); done  # globbed, in the checkout
  if [ ${#files[@]} -eq 0 ]; then say "no notebook matches NB_FILTER='${NB_FILTER:-}'"; return 1; fi
  rm -f "$WORK/notebooks-$profile.xml"  # a stale result must not stand for this run's
  printf '%s\n' "${files[@]}" > "$WORK/notebooks-$profile.requested"  # the report marks those without a result
  local parallel=()
  if [ "$jobs" -gt 1 ] && "$PY" -c 'import xdist' 2>/dev/null; then parallel=(-n "$jobs"); fi
  # shellcheck disable=SC2086
  (cd "$REPO" && LABSRC_PROFILE=$profile "$PY" -m pytest "${files[@]}" --nbmake --nbmake-kernel=labsrc \
      --nbmake-timeout="$timeout" -p no:cacheprovider -o addopts= "${parallel[@]}" \
      --junitxml="$WORK/notebooks-$profile.xml" --durations=0)
}

# name model batch image precision flags...
HEADLINE_BENCH="r18-fp32 resnet18 512 32 fp32
r18-tf32 resnet18 512 32 tf32
r18-bf16 resnet18 512 32 bf16
r18-fp16 resnet18 512 32 fp16
r18-bf16-cl resnet18 512 32 bf16 --channels-last
r18-bf16-cl-compile resnet18 512 32 bf16 --channels-last --compile
r50-fp32 resnet50 128 224 fp32
r50-tf32 resnet50 128 224 tf32
r50-bf16 resnet50 128 224 bf16
r50-fp16 resnet50 128 224 fp16
r50-bf16-cl resnet50 128 224 bf16 --channels-last
r50-bf16-cl-compile resnet50 128 224 bf16 --channels-last --compile"
DRY_BENCH="tiny-fp32 tiny_cnn 32 16 fp32"

stage_bench() {
  local set=${BENCH_SET:-$HEADLINE_BENCH} only=${BENCH_ONLY:-} steps=${BENCH_STEPS:-20} warmup=${BENCH_WARMUP:-5}
  [ "$DRY" = 1 ] && set=$DRY_BENCH && steps=2 && warmup=1
  mkdir -p "$WORK/bench"
  local failed=0 name model batch image precision flags
  while read -r name model batch image precision flags; do
    [ -z "$name" ] && continue
    if [ -n "$only" ] && ! [[ " $only " == *" $name "* ]]; then continue; fi
    say "bench $name"
    # shellcheck disable=SC2086
    (cd "$REPO" && "$PY" -m labsrc.bench --model "$model" --batch-size "$batch" --image-size "$image" \
        --precision "$precision" $flags --steps "$steps" --warmup "$warmup" --out "$WORK/bench/$name.json") \
        < /dev/null > "$WORK/logs/bench-$name.log" 2>&1 || { failed=1; say "bench $name failed: $(tail -n 3 "$WORK/logs/bench-$name.log")"; }
  done <<< "$set"
  return $failed
}

stage_capstone() {
  local profile=gpu args
  read -r -a args <<< "${CAPSTONE_ARGS:---data synthetic}"
  [ "$DRY" = 1 ] && profile=ci
  (cd "$REPO" && LABSRC_RUNS="$WORK/runs" "$PY" -m labsrc.launch --nproc 1 --profile "$profile" --timeout 540 capstone -- "${args[@]}") \
      | tee "$WORK/capstone.log"
}

stage_report() {
  "$PY" "$REPO/tools/gpu_truth_report.py" "$WORK" --out "${REPORT_DIR:-$WORK/report}" $([ "$DRY" = 1 ] && echo --dry)
}

stage_pack() {
  local dest=${OUT:-$WORK/..} log run
  # The launcher's logs of every run since the kit started (a failed notebook names its launcher.log).
  while read -r log; do
    run=$(basename "$(dirname "$(dirname "$log")")")-$(basename "$(dirname "$log")")
    mkdir -p "$WORK/launch-logs/$run" && cp "$(dirname "$log")"/{launcher.log,*.error.json} "$WORK/launch-logs/$run/" 2>/dev/null
  done < <(find "$REPO/runs" -path "$WORK" -prune -o -name launcher.log -newer "$WORK/.started" -print 2>/dev/null)
  tar czf "$dest/gpu-truth-work.tgz" -C "$WORK" --exclude='*.pt' . && ls -la "$dest/gpu-truth-work.tgz"
}

# One stage, run by the loop below under its time limit: `gpu_truth.sh --stage NAME`.
if [ "${1:-}" = "--stage" ]; then "stage_$2"; exit $?; fi

for stage in "$@"; do
  declare -F "stage_$stage" >/dev/null || { say "unknown stage '$stage' (see the top of $0)"; exit 2; }
done
status=0
for stage in "$@"; do
  say "stage $stage (limit ${STAGE_LIMIT:-570} s)"
  start=$(date +%s.%N)
  # Each stage under its limit (a device command has 10 minutes): SIGINT first, so pytest writes its report.
  timeout -s INT -k 30 "${STAGE_LIMIT:-570}" bash "$SELF" $([ "$DRY" = 1 ] && echo --dry) --stage "$stage" 2>&1 \
      | tee -i -a "$WORK/logs/$stage.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && say "stage $stage: stopped at its ${STAGE_LIMIT:-570} s limit"
  seconds=$(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $start}")
  echo "{\"stage\": \"$stage\", \"rc\": $rc, \"seconds\": $seconds, \"dry\": $DRY}" >> "$WORK/stages.jsonl"
  say "stage $stage: exit $rc in ${seconds}s"
  [ "$rc" -ne 0 ] && status=1
  if [ "$stage" = setup ] && [ "$rc" -ne 0 ]; then say "setup failed: the other stages need its venv"; exit 1; fi
done
exit $status
