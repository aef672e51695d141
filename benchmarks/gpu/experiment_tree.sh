#!/usr/bin/env bash
# An experiment tree for the profile phase (PROFILE_TREES=NAME): the carried patched tree of VERSION with
# DIFF applied, carried as the files that differ from the pristine tree (phase.py lays them over it).
#
#   benchmarks/gpu/experiment_tree.sh DEST VERSION NAME DIFF
#
# DEST is a carry folder prepare.sh built (it holds sglang-VERSION-pristine.tar.xz and -patched.tar.xz);
# DIFF a unified diff whose paths start one folder above sglang/ (`--- patched/sglang/...`, as `diff -ru
# patched/ NAME/` writes it). Writes DEST/sglang-VERSION-NAME.files.tar.xz and prints what it holds.
# A hunk that does not apply exactly (no fuzz) stops it with patch's own message, and nothing is written.
set -euo pipefail
[ $# -eq 4 ] || { sed -n 2,10p "$0" >&2; exit 2; }
DEST=$(cd "$1" && pwd) VERSION=$2 NAME=$3 DIFF=$(cd "$(dirname "$4")" && pwd)/$(basename "$4")
case "$NAME" in pristine|patched|*/*|"") echo "NAME: $NAME cannot name an experiment tree" >&2; exit 2 ;; esac
for t in pristine patched; do
  [ -f "$DEST/sglang-$VERSION-$t.tar.xz" ] || { echo "$DEST/sglang-$VERSION-$t.tar.xz: missing (run prepare.sh $VERSION first)" >&2; exit 2; }
done
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir "$WORK/pristine" "$WORK/tree"
tar -xJf "$DEST/sglang-$VERSION-pristine.tar.xz" -C "$WORK/pristine"
tar -xJf "$DEST/sglang-$VERSION-patched.tar.xz" -C "$WORK/tree"
patch -s -p1 --fuzz=0 -d "$WORK/tree" --no-backup-if-mismatch < "$DIFF"
# every file that differs from the pristine tree: the patch's own and the experiment's
changed=$(cd "$WORK/tree" && find . -type f ! -path '*/__pycache__/*' | sort | while read -r f; do
  cmp -s "$f" "$WORK/pristine/$f" || echo "$f"; done)
[ -n "$changed" ] || { echo "$DIFF: the tree equals the pristine one" >&2; exit 2; }
out="$DEST/sglang-$VERSION-$NAME.files.tar.xz"
(cd "$WORK/tree" && echo "$changed" | tar -cJf "$out.part" -T -)
mv "$out.part" "$out"
echo "$out:"
echo "$changed" | sed 's/^/  /'
