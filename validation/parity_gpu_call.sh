#!/usr/bin/env bash
# One GPU call of validation/parity_gpu, from the repository root:
#   bash validation/parity_gpu_call.sh STAGE [validation/parity_gpu options]
# STAGE (e.g. .gpu) holds: wheels/ (the megatron-core 0.18.2 and 0.19.2 wheels), ML19/ and ML18/
# (Megatron-LM at core_r0.19.0 and core_v0.18.2: the root scripts, pyproject.toml and
# megatron/training, which is checked against the wheel's), whl/ (hatchling and its pure-Python
# needs: the package's build backend, for `pip install .` without a network) and te/
# (TransformerEngine's setup.sh and build payload: TE is built in the background, ~150 s; the
# cases that need no TE run meanwhile). The package is installed the way users install it,
# `pip install .`, into the Python that holds PyTorch.
# Writes under $OUT: parity-gpu.json.gz (the record, rewritten as each case ends),
# console.txt, pip-install.txt, te-setup-tail.txt. The cases' time budget is what is left of
# PARITY_END_S (default 520) seconds.
set -u
OUT=${OUT:-/tmp/parity_out}
STAGE=$1
shift
mkdir -p "$OUT" /tmp/te-chunks
if [ -f "$STAGE/te/setup.sh" ] && [ ! -f /tmp/te-setup.rc ] && [ ! -f /tmp/te-setup.started ]; then
  touch /tmp/te-setup.started
  cp "$STAGE"/te/te-payload.tar.xz.part01 /tmp/te-chunks/
  # 12 build jobs: 4 of the 16 cores stay with the cases that need no TE
  ( MAX_JOBS=12 TE_WAIT_S=500 bash "$STAGE"/te/setup.sh > /tmp/te-setup.out 2>&1; echo $? > /tmp/te-setup.rc ) &
fi
# uninstalled at the end: a later command on this machine (validation/megatron_lm's "shipped"
# runs) must not find the hotfix loaded by the package's .pth
trap 'PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip uninstall -q -y mfsdp-hotfix >/dev/null 2>&1' EXIT
if ! PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-index --no-deps --force-reinstall \
    --find-links "$PWD/$STAGE/whl" . > "$OUT/pip-install.txt" 2>&1; then
  tail -c 3000 "$OUT/pip-install.txt"
  exit 3
fi
python3 validation/parity_gpu --out "$OUT/parity-gpu.json.gz" --wheels "$STAGE/wheels" \
  --megatron-lm core-0.19.2="$STAGE/ML19" --megatron-lm core-0.18.2="$STAGE/ML18" "$@" \
  --budget-s $((${PARITY_END_S:-520} - SECONDS)) 2>&1 | tee "$OUT/console.txt"
rc=${PIPESTATUS[0]}
if [ -f /tmp/te-setup.out ]; then
  { echo "te-setup rc: $(cat /tmp/te-setup.rc 2>/dev/null || echo running)"; tail -c 3000 /tmp/te-setup.out; } > "$OUT/te-setup-tail.txt"
fi
exit $rc
