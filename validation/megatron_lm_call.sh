#!/usr/bin/env bash
# One GPU run of validation/megatron_lm, from the repository root:
#   bash validation/megatron_lm_call.sh TE_DIR [validation/megatron_lm options]
# e.g. TE_DIR=../te, --megatron-lm core-0.19.2=ML19 --megatron-lm core-0.18.2=ML18 --workers 14
# TE_DIR holds TransformerEngine's setup.sh and build payload: TE is built in the background
# (~150 s); the runs without TE (group "local") go first, the TE runs wait for it.
# Writes under $OUT: megatron-lm.json.gz (every record, rewritten as records come in),
# megatron-lm-summary.json.gz (at the end), console.txt and te-setup-tail.txt. The phase's time
# budget is what is left of MLM_END_S (default 560) seconds.
set -u
OUT=${OUT:-/tmp/mlm_out}
TE_DIR=$1
shift
mkdir -p "$OUT" /tmp/te-chunks
if [ -f "$TE_DIR/setup.sh" ] && [ ! -f /tmp/te-setup.rc ] && [ ! -f /tmp/te-setup.started ]; then
  touch /tmp/te-setup.started
  cp "$TE_DIR"/te-payload.tar.xz.part01 /tmp/te-chunks/
  # 12 build jobs: 4 of the 16 cores stay with the runs that need no TE
  ( MAX_JOBS=12 TE_WAIT_S=500 bash "$TE_DIR"/setup.sh > /tmp/te-setup.out 2>&1; echo $? > /tmp/te-setup.rc ) &
fi
python3 validation/megatron_lm --out "$OUT/megatron-lm.json.gz" "$@" \
  --budget-s $((${MLM_END_S:-560} - SECONDS)) 2>&1 | tee "$OUT/console.txt"
rc=${PIPESTATUS[0]}
if [ -f /tmp/te-setup.out ]; then
  { echo "te-setup rc: $(cat /tmp/te-setup.rc 2>/dev/null || echo running)"; tail -c 3000 /tmp/te-setup.out; } > "$OUT/te-setup-tail.txt"
fi
exit $rc
