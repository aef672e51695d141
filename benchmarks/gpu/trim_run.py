#!/usr/bin/env python3
"""Leave a committed call folder's bulky files in its results tarball only.

  python3 benchmarks/gpu/trim_run.py RUN_DIR [RUN_DIR ...] [--dry-run]

Every file a device call carries counts against its 64 MiB, the checkout's own included, so each
megabyte committed here is one less for the sglang wheels (at 34 MB the 0.5.17 carry took three store
calls before each phase call). A call folder unpacked from its `results-*.tar.gz` holds each server's
log and each closed-loop level's metrics snapshots twice: unpacked and in the tarball. This removes the
unpacked copy of the servers' logs (`*.log`) and of the metrics snapshots (`*-metrics-start.txt`,
`*-metrics-end.txt`, which closed_summary.py reads from the tarball when they are not beside it), and
only where the tarball's member of the same name has the same bytes. The rows, summaries and py-spy
samples the other scripts read stay unpacked. Prints what it removed and the bytes freed.
"""
import argparse
import glob
import hashlib
import os
import sys

from steady_summary import tarball_files

BULKY = ("*.log", "*-metrics-start.txt", "*-metrics-end.txt")


def _digest(data):
    return hashlib.sha256(data).hexdigest()


def tarball_digests(run):
    """basename -> the sha256 of each file member of the call's results tarballs."""
    found = {}
    for name, read in tarball_files(run):
        found.setdefault(name, set()).add(_digest(read()))
    return found


def trim(run, dry_run=False):
    """The (path, bytes) of the unpacked bulky files of `run` that its tarball holds byte for byte,
    removed unless `dry_run`."""
    in_tarball = tarball_digests(run)
    removed = []
    for pattern in BULKY:
        for path in sorted(glob.glob(os.path.join(run, pattern))):
            with open(path, "rb") as f:
                data = f.read()
            if _digest(data) in in_tarball.get(os.path.basename(path), ()):
                removed.append((path, len(data)))
                if not dry_run:
                    os.remove(path)
    return removed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    a = ap.parse_args()
    missing = [run for run in a.runs if not glob.glob(os.path.join(run, "results-*.tar.gz"))]
    if missing:
        ap.error(f"no results-*.tar.gz in {', '.join(missing)}: nothing there has a second copy")
    total = 0
    for run in a.runs:
        for path, size in trim(run, a.dry_run):
            total += size
            print(f"{'would remove' if a.dry_run else 'removed'} {path} ({size:,} bytes, kept in the tarball)")
    print(f"{total:,} bytes {'would be ' if a.dry_run else ''}freed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
