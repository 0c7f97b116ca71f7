#!/usr/bin/env bash
# Builds the abi3 release wheel into .device/wheels/ (ignored by git) for the GPU machine.
# Usage: scripts/build-wheel.sh    then copy ".device" to the GPU machine with the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .device/wheels
mkdir -p .device/wheels
# "linux": built against this machine's glibc (2.36); the GPU machine has 2.39.
python3 -m maturin build --release --compatibility linux --out .device/wheels "$@" >&2
ls -l .device/wheels
