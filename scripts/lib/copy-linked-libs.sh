# Sourced by the stage-*-for-device.sh scripts.
# copy_linked_libs BINARY DEST [SKIP_UNDER]: copies into DEST the shared libraries BINARY links
# (as ldd resolves them with the caller's LD_LIBRARY_PATH), except glibc's and the C++ runtime
# (every host has its own) and those under SKIP_UNDER (already staged); a library DEST holds is
# kept.
copy_linked_libs() {
  local bin=$1 dest=$2 skip=${3:-}
  ldd "$bin" | awk '/=> \// {print $3}' \
    | { if [ -n "$skip" ]; then grep -v "^$skip/" || true; else cat; fi; } \
    | { grep -Ev '/(libc|libm|libpthread|libdl|librt|libresolv|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' || true; } \
    | while read -r lib; do cp -Ln "$lib" "$dest/" 2>/dev/null || true; done
}
