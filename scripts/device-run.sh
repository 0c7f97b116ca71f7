#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root:
#   bash scripts/device-run.sh [step ...]      steps: check demo precompile tests tests:<args> bench:<name>[:args] py:<script> bin:<name>
# bin:<name> runs a cargo bench executable built here and copied to .device/bin/<name>
# (docs/development.md), its record written under $OUT.
# Installs the wheel built by scripts/build-wheel.sh (copied along in .device/) into a scratch
# folder, then runs each step, writing logs and JSON under $OUT (or ./device-out).
# The wheel holds the Python package too: rebuild it after changing python/, not only crates/.
# World size: the multi-rank GPU suites read MORI_TEST_WORLD from the environment (default 2);
# benchmarks take --world (e.g. bench:ccl:--world,4).
# Evidence: every pytest step writes a JUnit XML report to $OUT/tests/ (NN-<tests>-world<W>.xml),
# to be committed under benches/results/tests/ beside the benchmark records. Pytest runs with -s:
# the ranks' processes write their case timings and failures straight to pytest.txt, so a step
# stopped by BUDGET (device-pack.sh) still shows how far each rank got.
set -uo pipefail
# NVLink multicast must never be used on the shared host.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
SITE=/tmp/mori-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" --upgrade .device/wheels/mori-*.whl \
  || { echo "wheel install failed (run scripts/build-wheel.sh here and carry .device)"; exit 1; }
# Baselines measured in the same run (e.g. DeepEP's wheel built for the GPU machine),
# carried as .device/baselines/*.whl, are installed beside mori.
for wheel in .device/baselines/*.whl; do
  [ -e "$wheel" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" --upgrade "$wheel" \
    || { echo "baseline wheel $wheel did not install"; exit 1; }
done
export PYTHONPATH="$SITE:$PWD"
export MORI_JIT_CACHE_DIR=${MORI_JIT_CACHE_DIR:-/tmp/mori-jit}
# libfabric copied along by scripts/device-libfabric.sh (the GPU machine has none).
if [ -e .device/libfabric/libfabric.so.1 ]; then
  export LD_LIBRARY_PATH="$PWD/.device/libfabric${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export MORI_REQUIRE_LIBFABRIC=1
fi
[ $# -gt 0 ] || set -- check tests
echo "MORI_TEST_WORLD=${MORI_TEST_WORLD:-2 (default)}"
status=0
reports=0
mkdir -p "$OUT/tests"
# Sets $report, the JUnit file of the next pytest step: numbered, named after its arguments and the world.
junit() {
  reports=$((reports + 1))
  local what
  what=$(printf '%s' "$1" | tr -c 'A-Za-z0-9_.-' '_' | sed 's/\.py//g; s/__*/_/g; s/^[-_]*//; s/_$//')
  report=$(printf '%s/tests/%02d-%s-world%s.xml' "$OUT" "$reports" "${what:-all}" "${MORI_TEST_WORLD:-2}")
}
for step in "$@"; do
  echo "=== $step ==="
  case "$step" in
    check)
      nvidia-smi topo -m 2>&1 | tee "$OUT/nvidia-smi-topo.txt"
      python3 -m mori check 2>&1 | tee "$OUT/check.txt" || status=1 ;;
    demo)
      python3 -m mori demo 2>&1 | tee "$OUT/demo.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    precompile)
      python3 -m mori precompile 2>&1 | tee "$OUT/precompile.txt" || status=1 ;;
    tests)
      junit all
      python3 -m pytest tests -rs -q -s -p no:cacheprovider --timeout 90 --junitxml="$report" 2>&1 | tee -a "$OUT/pytest.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    tests:*)
      junit "${step#tests:}"
      python3 -m pytest -rs -q -s -p no:cacheprovider --timeout 90 --junitxml="$report" ${step#tests:} 2>&1 | tee -a "$OUT/pytest.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    bench:*)
      spec=${step#bench:}; name=${spec%%:*}; args=""; [ "$spec" != "$name" ] && args=${spec#*:}
      python3 -m mori bench "$name" --out "$OUT" ${args//,/ } 2>&1 | tee -a "$OUT/bench-$name.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    py:*)
      script=${step#py:}
      python3 "$script" 2>&1 | tee "$OUT/$(basename "$script" .py).txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    bin:*)
      name=${step#bin:}
      MORI_BENCH_OUT="$OUT" ".device/bin/$name" --bench 2>&1 | tee "$OUT/bin-$name.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
exit $status
