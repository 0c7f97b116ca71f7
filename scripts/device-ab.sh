#!/usr/bin/env bash
# Same-run before/after of the host-side data paths, on the GPU machine (16 cores): the wheel in
# .device/before/ (built from the commit before a change: `git worktree add /tmp/before REV`,
# then scripts/build-wheel.sh there, copied to .device/before/) against .device/wheels/ (this
# checkout). Rounds alternate before, after, before, after, so drift hits both alike. Both
# versions run the same measuring scripts, which use only public API present in both:
#   umbp:  benches/umbp_ab.py                 (master + 2 peers over loopback, values over mori.io)
#   io:    benches/io_ab.py --routes tcp,direct
#   ipc:   benches/io_ab.py --routes cuda_ipc (two processes on GPU 0)
# Output: $OUT/$TAG.tgz (default ab; logs and JSON per round).
# Usage: BUDGET=540 ROUNDS=2 WHAT="umbp io ipc" TAG=ab bash scripts/device-ab.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
scratch=/tmp/dout-${TAG:-ab}; rm -rf "$scratch"; mkdir -p "$scratch"
repo=$PWD
deadline=$(( $(date +%s) + ${BUDGET:-540} ))
for which in before after; do
  wheel=.device/wheels/mori-*.whl
  [ "$which" = before ] && wheel=.device/before/mori-*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-$which" --upgrade $wheel \
    || { echo "installing the $which wheel failed"; exit 1; }
done
left() { echo $(( deadline - $(date +%s) )); }
for round in $(seq 1 "${ROUNDS:-2}"); do
  for which in before after; do
    dir=$scratch/$round-$which; mkdir -p "$dir"
    export PYTHONPATH=/tmp/site-$which MORI_JIT_CACHE_DIR=/tmp/jit-$which
    for what in ${WHAT:-umbp io ipc}; do
      budget=$(left); [ "$budget" -gt 20 ] || { echo "out of time before $round-$which-$what"; break 3; }
      case $what in
        umbp) cmd=(python3 "$repo/benches/umbp_ab.py" --bytes $((256 << 20)) --rounds 5 --out "$dir/umbp.json") ;;
        io) cmd=(python3 "$repo/benches/io_ab.py" --routes tcp,direct --trials "${TRIALS:-30}" --out "$dir/io.json") ;;
        ipc) cmd=(python3 "$repo/benches/io_ab.py" --routes cuda_ipc --trials "${TRIALS:-30}" --out "$dir/ipc.json") ;;
      esac
      (cd /tmp && timeout "$(( budget < 240 ? budget : 240 ))" "${cmd[@]}") > "$dir/$what.log" 2>&1
      echo "$round $which $what rc=$?" | tee -a "$scratch/summary.txt"
    done
  done
done
tar czf "$OUT/${TAG:-ab}.tgz" -C "$scratch" .
