#!/usr/bin/env bash
# GPU machine: scripts/device-run.sh steps with OUT in a scratch folder, bounded by BUDGET
# seconds, then everything packed into $OUT/TAG.tgz (the device tool brings back at most 8
# files, so the logs, junit XML and records travel as one).
# Usage: BUDGET=540 bash scripts/device-pack.sh TAG WORLD step...
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
tag=$1; world=$2; shift 2
scratch=/tmp/dout-$tag; mkdir -p "$scratch"
start=$(date +%s)
MORI_TEST_WORLD=$world OUT=$scratch timeout --signal=INT -k 15 "${BUDGET:-540}" bash scripts/device-run.sh "$@" > "$scratch/run.log" 2>&1
rc=$?
echo "rc=$rc after $(( $(date +%s) - start )) s" >> "$scratch/run.log"
grep -E "^=== |passed|failed|error|rc=" "$scratch/run.log" | tail -60
tar czf "$OUT/$tag.tgz" -C "$scratch" .
exit $rc
