#!/usr/bin/env bash
# Wall time of `mfsdp-hotfix selftest --gpu` (the default route: layer auto, which takes
# TransformerEngine's LayerNormMLP when TE is importable) on one GPU, for megatron-fsdp 0.6.1.
#   bash benchmarks/selftest_gpu_wall.sh STAGE [BASELINE]
# STAGE holds te/ (TransformerEngine's setup.sh and build payload); validation/wheels holds the
# megatron-fsdp 0.6.1 wheel; BASELINE (optional) is an older checkout of the package to time the
# same way. First without TE, then TE is built (nothing else running) and each selftest runs
# alone with it. Each result is
# appended to $OUT/selftest-gpu-wall.txt as soon as it is known, with the GPU's name.
set -u
OUT=${OUT:-/tmp/selftest_wall}
STAGE=$1
BASELINE=${2:-}
mkdir -p "$OUT" /tmp/te-chunks
RESULT="$OUT/selftest-gpu-wall.txt"
nvidia-smi --query-gpu=name --format=csv,noheader > "$RESULT"
python3 -m pip install -q --no-deps --target /tmp/rel/fsdp-0.6.1 \
  validation/wheels/megatron_fsdp-0.6.1-py3-none-any.whl || exit 3
time_selftest() {  # LABEL FOLDER [selftest options]
  local label=$1 folder=$2
  shift 2
  local t0 rc
  t0=$EPOCHREALTIME
  (cd "$folder" && python3 -m mfsdp_hotfix selftest --gpu --path /tmp/rel/fsdp-0.6.1 "$@") \
    > "$OUT/$label.txt" 2>&1
  rc=$?
  printf '%s: rc %d, %.1f s wall (%s)\n' "$label" "$rc" "$(python3 -c "print($EPOCHREALTIME - $t0)")" \
    "$*" >> "$RESULT"
}

# without TransformerEngine importable: layer auto is the emulated contract
time_selftest current-no-te "$PWD"
cp "$STAGE"/te/te-payload.tar.xz.part01 /tmp/te-chunks/
start=$SECONDS
bash "$STAGE"/te/setup.sh > "$OUT/te-setup.txt" 2>&1
echo "te setup: rc $? in $((SECONDS - start)) s" >> "$RESULT"
# shellcheck disable=SC1091
source /tmp/te-env.sh
time_selftest current-te "$PWD"
[ -n "$BASELINE" ] && time_selftest baseline-te "$BASELINE"
cat "$RESULT"
