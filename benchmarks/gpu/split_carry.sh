#!/usr/bin/env bash
# Fit a carry folder into the calls that carry it (prepare.sh runs this as its last step).
#
#   benchmarks/gpu/split_carry.sh DEST          one call carries at most CARRY_MIB (64) MiB together with the
#                                               checkout's own files (those of the current directory's git
#                                               work tree): what does not fit DEST moves to DESTa (then
#                                               DESTb, DESTc), each carried in a `phase.py store` call to
#                                               the warm machine just before the phase's calls; a file too
#                                               large for what is left is cut in two (NAME.part-a in a store
#                                               folder, NAME.part-b in DEST), which phase.py joins; phase.py
#                                               checks every stored file against DEST/SHA256SUMS
#   benchmarks/gpu/split_carry.sh --join DEST   undo it: the store folders' files back into DEST, parts joined
#
# Moved are the tarballs and wheels/, the largest first, each into the first store folder with room;
# bin/, MANIFEST, SHA256SUMS and the small files (kernel version, adaptive config) stay in DEST, and
# each store folder gets its own bin/ for its call.
set -euo pipefail
AUX=(a b c)  # DESTa, DESTb, DESTc: the store calls before the phase's
if [ "${1:-}" = --join ]; then
  DEST="${2:?usage: split_carry.sh --join DEST}"; DEST="${DEST%/}"
  for X in "${AUX[@]}"; do
    A="$DEST$X"
    [ -d "$A" ] || continue
    for P in "$A"/*.part-a; do
      [ -f "$P" ] || continue
      F=$(basename "$P" .part-a)
      if [ ! -f "$DEST/$F.part-b" ]; then echo "$P: no $DEST/$F.part-b to join it with"; exit 1; fi
      cat "$P" "$DEST/$F.part-b" > "$DEST/$F.joining" && mv "$DEST/$F.joining" "$DEST/$F" && rm "$P" "$DEST/$F.part-b"
    done
    find "$A" -mindepth 1 -maxdepth 1 ! -name bin ! -name SHA256SUMS -exec mv -t "$DEST" {} +
    rm -rf "$A"
  done
  exit 0
fi
DEST="${1:?usage: split_carry.sh DEST}"; DEST="${DEST%/}"
[ -d "$DEST" ] || { echo "$DEST: no such carry folder"; exit 2; }
for X in "${AUX[@]}"; do
  if [ -d "$DEST$X" ]; then echo "$DEST$X exists: join it first (split_carry.sh --join $DEST)"; exit 2; fi
done

size() { du -sb "$@" | awk '{s += $1} END {print s + 0}'; }
too_large() {  # nothing half-changed: DEST as it was
  echo "carry too large for $(( ${#AUX[@]} + 1 )) calls: $(size "$DEST") bytes left in ${DEST##*/}, $LIMIT a call"
  bash "${BASH_SOURCE[0]}" --join "$DEST"; exit 1
}
(cd "$DEST" && find . -type f ! -name SHA256SUMS ! -name MANIFEST ! -path './bin/*' | sort | xargs -r sha256sum) \
  > "$DEST/SHA256SUMS"
REPO_BYTES=$({ git ls-files -z || true; git ls-files -z -o --exclude-standard || true; } 2>/dev/null \
  | { xargs -0 -r stat -c %s -- 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}')
LIMIT=$(( ${CARRY_MIB:-64} * 1048576 - REPO_BYTES - ${SPARE_BYTES:-1048576} ))
[ "$(size "$DEST")" -gt "$LIMIT" ] || { echo "one call: ${DEST##*/} $(size "$DEST") bytes, $LIMIT a call"; exit 0; }

new_aux() {  # the next store call's folder, with its own bin/ for `phase.py store`
  local X
  for X in "${AUX[@]}"; do
    if [ ! -d "$DEST$X" ]; then mkdir "$DEST$X"; cp -r "$DEST/bin" "$DEST/SHA256SUMS" "$DEST$X/"; echo "$DEST$X"; return; fi
  done
}
# whole files, the largest first, each into the first store folder it fits (a new one if none)
for F in $(cd "$DEST" && du -sb -- *.tar.xz wheels 2>/dev/null | sort -rn | awk '{print $2}'); do
  [ "$(size "$DEST")" -gt "$LIMIT" ] || break
  for X in "${AUX[@]}" new; do
    if [ "$X" = new ]; then
      [ $(( $(size "$DEST/bin" "$DEST/SHA256SUMS") + $(size "$DEST/$F") )) -le "$LIMIT" ] || break
      A=$(new_aux); [ -n "$A" ] || break
    else
      A="$DEST$X"; [ -d "$A" ] || continue
      [ $(( $(size "$A") + $(size "$DEST/$F") )) -le "$LIMIT" ] || continue
    fi
    mv "$DEST/$F" "$A/"; break
  done
done
# still over: the largest tarball left is cut, its first part into a store folder with room
OVER=$(( $(size "$DEST") - LIMIT ))
if [ "$OVER" -gt 0 ]; then
  F=$(cd "$DEST" && ls -S -- *.tar.xz 2>/dev/null | head -1)
  [ -n "$F" ] && [ "$(size "$DEST/$F")" -gt "$OVER" ] || too_large
  A=""
  for X in "${AUX[@]}"; do
    if [ -d "$DEST$X" ] && [ $(( $(size "$DEST$X") + OVER )) -le "$LIMIT" ]; then A="$DEST$X"; break; fi
  done
  [ -n "$A" ] || A=$(new_aux)
  [ -n "$A" ] && [ $(( $(size "$A") + OVER )) -le "$LIMIT" ] || too_large
  head -c "$OVER" "$DEST/$F" > "$A/$F.part-a"
  tail -c +$((OVER + 1)) "$DEST/$F" > "$DEST/$F.part-b"
  rm "$DEST/$F"
fi
CALLS=""
for X in "${AUX[@]}"; do
  A="$DEST$X"; [ -d "$A" ] || continue
  CALLS+="${A##*/} ($(size "$A") bytes: $(cd "$A" && ls | grep -v -x -e bin -e SHA256SUMS | tr '\n' ' ' | sed 's/ $//')), "
done
echo "store calls: ${CALLS}then ${DEST##*/} ($(size "$DEST") bytes); $LIMIT bytes a call beside the checkout's $REPO_BYTES"
