#!/usr/bin/env bash
# The test command (README, and CI through .ci/run). On a fresh machine it creates .venv-test
# with what the tests need, then runs the Rust tests, builds the extension into .venv-test and
# runs the Python tests. Your own environment (.venv, where `pip install .` goes) is left alone.
# GPU tests are skipped, with the reason, where no GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

step() { printf '\n=== %s ===\n' "$*"; }

VENV=.venv-test
step "python environment for the tests ($VENV)"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# NVRTC from PyPI lets CI compile every kernel without a GPU or a CUDA toolkit; Triton (no torch
# needed, ptxas bundled) lets it compile the mori.ir Triton kernels to sm_90 PTX the same way.
"$VENV/bin/python" -m pip install -q "maturin>=1.7,<2" "pytest>=7" "numpy>=1.24" "nvidia-cuda-nvrtc==13.0.*" "triton==3.6.*"
# Mooncake Store (no CUDA build) for the tests of `mori bench umbp`'s Mooncake baseline.
"$VENV/bin/python" -m pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1"

step "system packages: redis-server, redis-tools, libfabric1, and what Mooncake links"
# The umbp metadata tests start their own redis-server processes on loopback ports (a single
# server and a 3-node cluster); they fail instead of skipping when MORI_REQUIRE_REDIS=1.
# mori-net's fabric tests load libfabric at run time (its tcp provider runs the RMA calls over
# loopback); they fail instead of skipping when MORI_REQUIRE_LIBFABRIC=1.
missing=()
command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 || missing+=(redis-server redis-tools)
ldconfig -p 2>/dev/null | grep -q 'libfabric\.so\.1 ' || missing+=(libfabric1)
# Mooncake's store links these beyond its wheel's own libraries.
for pkg in libcurl.so.4:libcurl4 libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1; do
  ldconfig -p 2>/dev/null | grep -q "${pkg%%:*} " || missing+=("${pkg#*:}")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "redis-server, redis-cli, libfabric and the libraries Mooncake links found: nothing to install"
elif [ "$(id -u)" -eq 0 ]; then
  echo "missing: installing the system packages ${missing[*]} (apt-get install)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "missing system packages: install them first (sudo apt-get install ${missing[*]})" >&2
  exit 1
fi
export MORI_REQUIRE_REDIS=1 MORI_REQUIRE_LIBFABRIC=1 MORI_REQUIRE_MOONCAKE=1
# mori-net's two-host tests make their own network namespaces and veth pair: root only.
if [ "$(id -u)" -eq 0 ]; then export MORI_REQUIRE_NETNS=1; fi

step "io_uring"
# Rust tests cannot report a skip: where the kernel allows io_uring, MORI_REQUIRE_URING=1 makes
# the io_uring test variants fail instead of passing without running. Where it does not, pytest
# reports the skip with the reason (tests/test_umbp.py::test_embedded_uring_backend_or_a_reported_skip).
cargo build -q -p mori-umbp --example uring_probe
if uring=$(target/debug/examples/uring_probe); then
  export MORI_REQUIRE_URING=1
  echo "$uring: MORI_REQUIRE_URING=1 (the io_uring tests must run and pass)"
else
  echo "$uring: the io_uring test variants are skipped (pytest lists the skip and its reason)"
fi

step "nvrtc for the Rust tests"
# mori-collective compiles its parameter layouts against the kernels with NVRTC
# (crates/collective/tests/nvrtc_layout.rs): the Rust tests get the wheel's libnvrtc, and a
# missing NVRTC fails there instead of printing a skip. (pytest finds the wheel on its own.)
nvrtc=$("$VENV/bin/python" -c 'import glob, sysconfig; print(glob.glob(sysconfig.get_path("purelib") + "/nvidia/cu13/lib/libnvrtc.so.13")[0])')
rust_test_env=(env MORI_NVRTC_PATH="$nvrtc" MORI_REQUIRE_NVRTC=1)
echo "Rust tests: MORI_NVRTC_PATH=$nvrtc MORI_REQUIRE_NVRTC=1"

step "rust: format and lints"
if cargo fmt --version >/dev/null 2>&1; then cargo fmt --all --check; fi
if cargo clippy --version >/dev/null 2>&1; then cargo clippy --workspace --all-targets --quiet -- -D warnings; fi

step "rust: unit and integration tests"
if cargo nextest --version >/dev/null 2>&1; then
  "${rust_test_env[@]}" cargo nextest run --workspace --no-fail-fast
else
  "${rust_test_env[@]}" cargo test --workspace
fi

step "rust: cargo bench, quick (the host benches run; figures not kept)"
# Debug profile (shares the test build) and short samples: this proves the bench targets run
# and check their own results; `cargo bench` (release, full samples) is what measures.
MORI_BENCH_QUICK=1 MORI_BENCH_OUT="$(mktemp -d)" cargo bench --profile dev -q -p mori-io -p mori-bootstrap -p mori-umbp -p mori-net -p mori-collective -p mori-shmem --benches

step "python: build the extension into $VENV"
VIRTUAL_ENV="$PWD/$VENV" "$VENV/bin/maturin" develop --release --quiet

step "python: tests"
# pytest exits 5 when it collected nothing: that is a failure here, like any non-zero status.
"$VENV/bin/python" -m pytest tests -rs -q -p no:cacheprovider
