#!/usr/bin/env bash
# One GPU run of validation/megatron_lm.py: TransformerEngine set up first (TE_DIR holds its
# setup.sh and build payload; every run needs TE: pretrain_gpt.py with --transformer-impl
# transformer_engine), then the phase. Run from the repository root:
#   bash validation/megatron_lm_call.sh TE_DIR [megatron_lm.py options]
# e.g. TE_DIR=../te, --megatron-lm core-0.19.2=ML19 --megatron-lm core-0.18.2=ML18
#      --groups core,dp1 --budget-s 360 --workers 12
# Writes under $OUT: megatron-lm.json.gz (every record, rewritten as records come in),
# megatron-lm-summary.json.gz (at the end), console.txt and te-setup-tail.txt.
set -u
OUT=${OUT:-/tmp/mlm_out}
TE_DIR=$1
shift
mkdir -p "$OUT" /tmp/te-chunks
if [ ! -f /tmp/te-env.sh ]; then
  cp "$TE_DIR"/te-payload.tar.xz.part01 /tmp/te-chunks/
  MAX_JOBS=16 TE_WAIT_S=400 bash "$TE_DIR"/setup.sh > /tmp/te-setup.out 2>&1
  echo "te-setup rc: $?" > "$OUT/te-setup-tail.txt"
  tail -c 3000 /tmp/te-setup.out >> "$OUT/te-setup-tail.txt"
fi
# shellcheck disable=SC1091
source /tmp/te-env.sh
# the phase's time budget: what is left of MLM_END_S (default 560) seconds after TE's setup
python3 validation/megatron_lm.py --out "$OUT/megatron-lm.json.gz" "$@" \
  --budget-s $((${MLM_END_S:-560} - SECONDS)) 2>&1 | tee "$OUT/console.txt"
exit "${PIPESTATUS[0]}"
