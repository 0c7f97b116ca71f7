#!/usr/bin/env bash
# Stages Mooncake Store (mooncake-transfer-engine-non-cuda, the CPython of the GPU machine) into
# .device/mooncake/ for `mori bench umbp` there, which has no internet: site.tgz holds the parts
# the store's Python client and mooncake_master need (not the wheel's EP, process-group and bench
# binaries, which would not fit the device's carry limit), lib.tgz the system libraries they link
# beyond glibc, copied from this machine. scripts/device-ab.sh unpacks site.tgz onto PYTHONPATH
# and puts on LD_LIBRARY_PATH only those of lib.tgz the GPU machine lacks.
# Usage: bash scripts/stage-mooncake-for-device.sh [python version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/copy-linked-libs.sh
py=${1:-3.12}
out=.device/mooncake
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --platform manylinux_2_28_x86_64 \
  -d "$work/dl" mooncake-transfer-engine-non-cuda
python3 -m pip install -q --no-deps --no-compile --target "$work/all" --python-version "$py" --only-binary=:all: \
  --platform manylinux_2_28_x86_64 "$work"/dl/*.whl
mkdir -p "$work/site/mooncake"
for f in __init__.py buffer_pool.py store.so mooncake_master libetcd_wrapper.so libasio.so; do
  cp "$work/all/mooncake/$f" "$work/site/mooncake/"
done
cp -r "$work"/all/mooncake_transfer_engine_non_cuda.libs "$work"/all/mooncake_transfer_engine_non_cuda-*.dist-info "$work/site/"
# store.so loads libetcd_wrapper.so from its own folder, mooncake_master the wheel's repaired copy
# of the same library under a hashed name: one copy (22 MB) and a link keep the staged tree
# inside the device's carry limit.
etcd=$(cd "$work/site/mooncake_transfer_engine_non_cuda.libs" && ls libetcd_wrapper-*.so)
ln -sf "../mooncake_transfer_engine_non_cuda.libs/$etcd" "$work/site/mooncake/libetcd_wrapper.so"
rm -rf "$out"; mkdir -p "$out" "$work/lib"
tar czf "$out/site.tgz" -C "$work/site" .
# The system libraries store.so and mooncake_master link, with what those link (not glibc's own).
for bin in "$work/site/mooncake/store.so" "$work/site/mooncake/mooncake_master"; do
  LD_LIBRARY_PATH="$work/site/mooncake:$work/site/mooncake_transfer_engine_non_cuda.libs" \
    copy_linked_libs "$bin" "$work/lib" "$work"
done
tar czf "$out/lib.tgz" -C "$work/lib" .
du -sh "$out"
