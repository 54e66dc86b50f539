#!/usr/bin/env bash
# One GPU run: TransformerEngine built in the background (if .te/ holds its build payload and
# setup.sh), then the phases.
#   bash validation/gpu_call.sh [gpu_phases.py options] --phases smoke|fuzz|te|long|oracles ...
# Needs validation/wheels (the release wheels) and, for real TE, .te (TE payload + setup.sh).
# Writes under $OUT: <phase>.json.gz per phase, console.txt (the driver's output) and
# te-setup-tail.txt (the TE build's log tail, when TE was set up): at most 7 files. Each run's
# work folder is its own (validation/workdir.py), so a machine kept warm mixes nothing.
# All phases share one queue, in the order given (= priority when --budget-s runs out); while
# TE is being built (~190 s, 4 workers) only emulated jobs run. Estimates from a first run's per-case
# times (emulated ~0.5 s, TE ~2 s, ~12 s per worker process), 14 workers; not measurements:
#   two runs:   A: --phases long fuzz --workers 14 --budget-s 540            (~7-8 min)
#               B: --phases oracles te --workers 14 --budget-s 540           (~7 min, TE warm)
#   one run:    --phases long fuzz oracles te --te-layers 6 --oracle-seeds 4 --workers 14
#               --budget-s 540  (about 9 min; te is cut first, at whole rows)
set -u
OUT=${OUT:-/tmp/mfsdp_out}
mkdir -p "$OUT"
if [ -f .te/setup.sh ] && [ ! -f /tmp/te-setup.rc ] && [ ! -f /tmp/te-setup.started ]; then
  touch /tmp/te-setup.started
  mkdir -p /tmp/te-chunks && cp .te/te-payload.tar.xz.part01 /tmp/te-chunks/
  # 12 build jobs: 4 of the 16 cores stay with the GPU workers that run meanwhile
  ( MAX_JOBS=12 TE_WAIT_S=500 bash .te/setup.sh > /tmp/te-setup.out 2>&1; echo $? > /tmp/te-setup.rc ) &
elif [ -f /tmp/te-setup.started ] && [ ! -f /tmp/te-setup.rc ] && [ -f /tmp/te/state/setup.sh ]; then
  # a build started by an earlier run that was cut: attach to it
  ( TE_WAIT_S=500 bash /tmp/te/state/setup.sh --wait >> /tmp/te-setup.out 2>&1; echo $? > /tmp/te-setup.rc ) &
fi
# the driver's console output comes back too (console.txt): commit it with the raw files
python3 validation/gpu_phases.py --out "$OUT" "$@" 2>&1 | tee "$OUT/console.txt"
rc=${PIPESTATUS[0]}
if [ -f /tmp/te-setup.out ]; then
  { echo "te-setup rc: $(cat /tmp/te-setup.rc 2>/dev/null || echo running)"; tail -c 4000 /tmp/te-setup.out; } > "$OUT/te-setup-tail.txt"
fi
ls -la "$OUT"
exit $rc
