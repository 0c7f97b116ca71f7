#!/usr/bin/env bash
# Copies this machine's redis-server and redis-benchmark (Debian's) with the libraries they link
# beyond glibc into .device/redis/, for the GPU machine, which has no Redis: `mori bench umbp`
# there then measures its Redis baseline in the same run. bin/ holds wrappers that run them with
# only their own libraries added to the search path; scripts/device-ab.sh puts bin/ first on PATH
# when it exists.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/copy-linked-libs.sh
out=.device/redis
rm -rf "$out"; mkdir -p "$out/bin" "$out/libexec" "$out/lib"
for tool in redis-server redis-benchmark; do
  real=$(command -v "$tool") || { echo "$tool is not installed here (apt-get install redis-server)"; exit 1; }
  cp -L "$real" "$out/libexec/$tool"
  copy_linked_libs "$real" "$out/lib"
  cat > "$out/bin/$tool" <<WRAP
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")
LD_LIBRARY_PATH="\$here/../lib" exec "\$here/../libexec/$tool" "\$@"
WRAP
  chmod +x "$out/bin/$tool"
done
du -sh "$out"
