#!/usr/bin/env bash
# Fit a carry folder into the calls that carry it (prepare.sh runs this as its last step).
#
#   benchmarks/gpu/split_carry.sh DEST          one call carries at most CARRY_MIB (64) MiB together with the
#                                               checkout's own files (those of the current directory's git
#                                               work tree): what does not fit moves to DESTa, carried in a
#                                               `phase.py store` call to the warm machine just before the
#                                               phase's call; a file too large for either folder is cut in
#                                               two (NAME.part-a in DESTa, NAME.part-b in DEST), which
#                                               phase.py joins and checks against DEST/SHA256SUMS
#   benchmarks/gpu/split_carry.sh --join DEST   undo it: DESTa's files back into DEST, parts joined
#
# Moved are the tarballs and wheels/, the largest first; bin/, MANIFEST, SHA256SUMS and the small
# files (kernel version, adaptive config) stay in DEST, and DESTa gets its own bin/ for the store call.
set -euo pipefail
if [ "${1:-}" = --join ]; then
  DEST="${2:?usage: split_carry.sh --join DEST}"; DEST="${DEST%/}"; A="${DEST}a"
  [ -d "$A" ] || exit 0
  for P in "$A"/*.part-a; do
    [ -f "$P" ] || continue
    F=$(basename "$P" .part-a)
    if [ ! -f "$DEST/$F.part-b" ]; then echo "$P: no $DEST/$F.part-b to join it with"; exit 1; fi
    cat "$P" "$DEST/$F.part-b" > "$DEST/$F.joining" && mv "$DEST/$F.joining" "$DEST/$F" && rm "$P" "$DEST/$F.part-b"
  done
  find "$A" -mindepth 1 -maxdepth 1 ! -name bin ! -name SHA256SUMS -exec mv -t "$DEST" {} +
  rm -rf "$A"
  exit 0
fi
DEST="${1:?usage: split_carry.sh DEST}"; DEST="${DEST%/}"; A="${DEST}a"
[ -d "$DEST" ] || { echo "$DEST: no such carry folder"; exit 2; }
if [ -d "$A" ]; then echo "$A exists: join it first (split_carry.sh --join $DEST)"; exit 2; fi

size() { du -sb "$@" | awk '{s += $1} END {print s + 0}'; }
too_large() {  # nothing half-changed: DEST as it was
  echo "carry too large for two calls: $(size "$A") + $(size "$DEST") bytes, $LIMIT a call"
  bash "${BASH_SOURCE[0]}" --join "$DEST"; exit 1
}
(cd "$DEST" && find . -type f ! -name SHA256SUMS ! -name MANIFEST ! -path './bin/*' | sort | xargs -r sha256sum) \
  > "$DEST/SHA256SUMS"
REPO_BYTES=$({ git ls-files -z || true; git ls-files -z -o --exclude-standard || true; } 2>/dev/null \
  | { xargs -0 -r stat -c %s -- 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}')
LIMIT=$(( ${CARRY_MIB:-64} * 1048576 - REPO_BYTES - ${SPARE_BYTES:-1048576} ))
[ "$(size "$DEST")" -gt "$LIMIT" ] || { echo "one call: ${DEST##*/} $(size "$DEST") bytes, $LIMIT a call"; exit 0; }

mkdir -p "$A"; cp -r "$DEST/bin" "$DEST/SHA256SUMS" "$A/"
for F in $(cd "$DEST" && du -sb -- *.tar.xz wheels 2>/dev/null | sort -rn | awk '{print $2}'); do
  [ "$(size "$DEST")" -gt "$LIMIT" ] || break
  if [ $(( $(size "$A") + $(size "$DEST/$F") )) -le "$LIMIT" ]; then mv "$DEST/$F" "$A/"; fi
done
OVER=$(( $(size "$DEST") - LIMIT ))
if [ "$OVER" -gt 0 ]; then
  F=$(cd "$DEST" && ls -S -- *.tar.xz 2>/dev/null | head -1)
  if [ -z "$F" ] || [ "$(size "$DEST/$F")" -le "$OVER" ]; then too_large; fi
  head -c "$OVER" "$DEST/$F" > "$A/$F.part-a"
  tail -c +$((OVER + 1)) "$DEST/$F" > "$DEST/$F.part-b"
  rm "$DEST/$F"
fi
[ "$(size "$A")" -le "$LIMIT" ] || too_large
echo "two calls: ${A##*/} ($(size "$A") bytes: $(cd "$A" && ls | grep -v -x -e bin -e SHA256SUMS | tr '\n' ' '))" \
  "in a store call, then ${DEST##*/} ($(size "$DEST") bytes); $LIMIT bytes a call beside the checkout's $REPO_BYTES"
