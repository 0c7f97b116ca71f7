#!/usr/bin/env bash
# Same-run before/after of the host-side data paths, on the GPU machine (16 cores): the wheel in
# .device/before/ (built from the commit before a change: `git worktree add /tmp/before REV`,
# then scripts/build-wheel.sh there, copied to .device/before/) against .device/wheels/ (this
# checkout). Rounds alternate before, after, before, after, so drift hits both alike. Both
# versions run the same measuring scripts, which use only public API present in both:
#   umbp:  benches/umbp_ab.py                 (master + 2 peers over loopback, values over mori.io)
#   io:    benches/io_ab.py --routes tcp,direct
#   ipc:   benches/io_ab.py --routes cuda_ipc (two processes on GPU 0)
#   ccl:   mori bench ccl --world 2 --max-bytes 1M (two ranks; host time per eager call)
#   ep:    mori bench ep --world 2 --sms 24 (two ranks; host time per dispatch/combine call)
#   facade: benches/ep_facade_host.py (one rank; host time per call, native beside the DeepEP facade)
#   smallthreads: benches/umbp_small_threads.py (4 KiB gets and puts from 1 and 4 Python threads)
#   smallcluster: benches/umbp_small_threads.py --cluster (the same against a master and 2 peers)
#   singlelarge: benches/umbp_single_large.py (1 and 4 MiB single gets and puts, one thread)
#   umbpbench: mori bench umbp (the whole side-by-side record; Redis's baseline when
#          scripts/stage-redis-for-device.sh staged it into .device/redis/, put first on PATH;
#          Mooncake Store's when scripts/stage-mooncake-for-device.sh staged .device/mooncake/)
# VARIANTS: which runs alternate (default "before after"); "after:VAR=value" runs the after
# wheel with an environment variable set (e.g. after:MORI_CHECKSUM_THREADS=1).
# SHAPES (umbp only): one run per shape, so the variants alternate shape by shape; AB_ARGS:
# more arguments of benches/umbp_ab.py (e.g. "--api bytes --pin").
# Output: $OUT/$TAG.tgz (default ab; logs and JSON per round).
# Usage: BUDGET=540 ROUNDS=2 WHAT="umbp io ipc" TAG=ab bash scripts/device-ab.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
scratch=/tmp/dout-${TAG:-ab}; rm -rf "$scratch"; mkdir -p "$scratch"
repo=$PWD
[ -d "$repo/.device/redis/bin" ] && export PATH="$repo/.device/redis/bin:$PATH"
deadline=$(( $(date +%s) + ${BUDGET:-540} ))
# Only the wheels the variants run (a run of "after" alone carries no before wheel).
for which in $(for v in ${VARIANTS:-before after}; do echo "${v%%:*}"; done | sort -u); do
  wheel=.device/wheels/mori-*.whl
  [ "$which" = before ] && wheel=.device/before/mori-*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-$which" --upgrade $wheel \
    || { echo "installing the $which wheel failed"; exit 1; }
done
# Mooncake Store for umbpbench's second baseline, when scripts/stage-mooncake-for-device.sh
# staged it: its Python client on PYTHONPATH, and of the system libraries it links those this
# machine lacks (each found by ldconfig here is left to this machine's copy).
mooncake_path=; mooncake_libs=
if [ -f .device/mooncake/site.tgz ]; then
  rm -rf /tmp/mooncake-site /tmp/mooncake-libs-staged /tmp/mooncake-libs
  mkdir -p /tmp/mooncake-site /tmp/mooncake-libs-staged /tmp/mooncake-libs
  tar xzf .device/mooncake/site.tgz -C /tmp/mooncake-site && tar xzf .device/mooncake/lib.tgz -C /tmp/mooncake-libs-staged
  for lib in /tmp/mooncake-libs-staged/*; do
    ldconfig -p | grep -q "^[[:space:]]*$(basename "$lib") " || ln -s "$lib" /tmp/mooncake-libs/
  done
  echo "mooncake: libraries taken from the staged copies: $(ls /tmp/mooncake-libs | tr '\n' ' ')"
  mooncake_path=:/tmp/mooncake-site; mooncake_libs=/tmp/mooncake-libs
fi
left() { echo $(( deadline - $(date +%s) )); }
for round in $(seq 1 "${ROUNDS:-2}"); do
  for what in ${WHAT:-umbp io ipc}; do
    shapes=all; [ "$what" = umbp ] && shapes=${SHAPES:-all}
    for shape in $shapes; do
      for variant in ${VARIANTS:-before after}; do
        which=${variant%%:*}; setting=; [ "$variant" != "$which" ] && setting=${variant#*:}
        dir=$scratch/$round-${variant//[:=]/_}; mkdir -p "$dir"
        budget=$(left); [ "$budget" -gt 20 ] || { echo "out of time before $round $variant $what $shape"; break 4; }
        only=(); [ "$shape" != all ] && only=(--shapes "$shape")
        case $what in
          umbp) cmd=(python3 "$repo/benches/umbp_ab.py" --bytes $((256 << 20)) --rounds 5 "${only[@]}" ${AB_ARGS:-} --out "$dir/umbp-$shape.json") ;;
          io) cmd=(python3 "$repo/benches/io_ab.py" --routes tcp,direct --trials "${TRIALS:-30}" --out "$dir/io.json") ;;
          ipc) cmd=(python3 "$repo/benches/io_ab.py" --routes cuda_ipc --trials "${TRIALS:-30}" --out "$dir/ipc.json") ;;
          ccl) cmd=(python3 -m mori bench ccl --world 2 --max-bytes 1M --trials "${TRIALS:-20}" --out "$dir") ;;
          ep) cmd=(python3 -m mori bench ep --world 2 --sms 24 --iters "${TRIALS:-10}" --out "$dir") ;;
          facade) cmd=(python3 "$repo/benches/ep_facade_host.py" --out "$dir") ;;
          singlelarge) cmd=(python3 "$repo/benches/umbp_single_large.py" --out "$dir") ;;
          smallthreads) cmd=(python3 "$repo/benches/umbp_small_threads.py" --out "$dir") ;;
          smallcluster) cmd=(python3 "$repo/benches/umbp_small_threads.py" --cluster --out "$dir") ;;
          umbpbench) cmd=(python3 -m mori bench umbp --out "$dir") ;;
        esac
        extra=()
        if [ "$what" = umbpbench ] && [ -n "$mooncake_libs" ]; then
          extra=(PYTHONPATH="/tmp/site-$which$mooncake_path" LD_LIBRARY_PATH="$mooncake_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
        fi
        (cd /tmp && env PYTHONPATH="/tmp/site-$which" "${extra[@]}" MORI_JIT_CACHE_DIR="/tmp/jit-$which" $setting \
          timeout "$(( budget < 240 ? budget : 240 ))" "${cmd[@]}") > "$dir/$what-$shape.log" 2>&1
        echo "$round $variant $what $shape rc=$?" | tee -a "$scratch/summary.txt"
      done
    done
  done
done
tar czf "$OUT/${TAG:-ab}.tgz" -C "$scratch" .
