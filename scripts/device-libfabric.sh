#!/usr/bin/env bash
# Copies this machine's libfabric (Debian's libfabric1: tcp, verbs, efa, psm2, shm ...
# providers built in, built without CUDA) and the libraries it loads into .device/libfabric/,
# for the GPU machine, which has no libfabric of its own. scripts/device-run.sh puts that folder
# on the loader path when it is there. glibc of the GPU machine is newer than Debian 12's,
# so the copies run there; libc and the loader themselves are not copied.
set -euo pipefail
cd "$(dirname "$0")/.."
lib=$(ldconfig -p | awk '/libfabric\.so\.1 /{print $NF; exit}')
[ -n "$lib" ] || { echo "libfabric.so.1 not found: apt-get install libfabric1" >&2; exit 1; }
dest=.device/libfabric
rm -rf "$dest" && mkdir -p "$dest"
cp -L "$lib" "$dest/libfabric.so.1"
ldd "$lib" | awk '/=>/{print $1, $3}' | while read -r name path; do
  case "$name" in libc.so.*|ld-linux*|libm.so.*|libpthread.so.*|libdl.so.*) continue ;; esac
  cp -L "$path" "$dest/$name"
done
ls "$dest"
