#!/bin/bash
# Stand-in for Proxmox VE's `pct`, following PVE's src/PVE/CLI/pct.pm:
#   pct exec <vmid> [--keep-env 0|1] -- cmd...  ->  exec lxc-attach -n <vmid> --keep-env|--clear-env -- cmd...
# argv after `--` reaches the command with no shell in between, PATH is forced, errors are a Perl
# `die` (exit 255) with the real messages. A "container" is $PCT_SHIM_ROOT/<vmid>/ holding `state`
# (running|stopped) and `root/` (the cwd, and $HOME under --keep-env 0). A file `lose_exit_status`
# there mimics LXC 3.0.4-3.2.1, which reported 0 for failing commands (lxc#3104).
# Stricter than the real one on purpose: only `--keep-env` may come before `--`, and `--` is required.
set -u
root=${PCT_SHIM_ROOT:?PCT_SHIM_ROOT is not set}
node=$(uname -n); node=${node%%.*}

{ printf '%q ' pct "$@"; printf '\n'; } >>"$root/calls.log"

die() { printf '%s\n' "$*" >&2; exit 255; }

config_of() {  # the vmid's directory, or the error pct gives for an unknown id
  [[ $1 =~ ^[1-9][0-9]*$ ]] || die "400 Parameter verification failed.
vmid: invalid format - value does not look like a valid VM ID"
  [ -d "$root/$1" ] || die "Configuration file 'nodes/$node/lxc/$1.conf' does not exist"
  printf '%s\n' "$root/$1"
}

state_of() { cat "$1/state" 2>/dev/null || echo stopped; }

cmd=${1:-}; shift || true
case $cmd in
  exec)
    [ $# -ge 1 ] || die "400 not enough arguments"
    vmid=$1; shift
    ct=$(config_of "$vmid") || exit 255
    keep_env=1                               # PVE 8 default; dynctl always passes it explicitly
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do
      case $1 in
        --keep-env) [ $# -ge 2 ] || die "400 Parameter verification failed."; keep_env=$2; shift 2 ;;
        *) die "pct shim: unexpected argument '$1' before '--' (the shim requires: exec <vmid> [--keep-env 0|1] -- cmd...)" ;;
      esac
    done
    [ $# -ge 1 ] && shift                    # the `--`
    [ $# -ge 1 ] || die "missing command"
    [ "$(state_of "$ct")" = running ] || die "container '$vmid' not running!"
    cd "$ct/root" || die "cannot enter container root $ct/root"
    forced_path=/sbin:/bin:/usr/sbin:/usr/bin
    case $keep_env in
      0|false|no) run=(env -i "PATH=$forced_path" "HOME=$ct/root" container=lxc "DYNTEST_RUN=${DYNTEST_RUN:-}") ;;
      1|true|yes) export PATH=$forced_path; run=() ;;
      *) die "400 Parameter verification failed.
keep-env: type check ('boolean') failed - got '$keep_env'" ;;
    esac
    if [ -e "$ct/lose_exit_status" ]; then
      "${run[@]}" "$@"
      exit 0
    fi
    exec "${run[@]}" "$@"
    ;;
  status)
    ct=$(config_of "${1:-}") || exit 255
    echo "status: $(state_of "$ct")"
    ;;
  start)
    ct=$(config_of "${1:-}") || exit 255
    [ "$(state_of "$ct")" = running ] && die "CT ${1} already running"
    echo running >"$ct/state"
    ;;
  stop)
    ct=$(config_of "${1:-}") || exit 255
    [ "$(state_of "$ct")" = running ] || die "CT ${1} not running"
    echo stopped >"$ct/state"
    ;;
  list)
    printf '%-10s %-10s %-12s %s\n' VMID Status Lock Name
    for d in "$root"/*/; do
      [ -f "$d/state" ] || continue
      id=$(basename "$d")
      printf '%-10s %-10s %-12s %s\n' "$id" "$(state_of "$d")" "" "ct$id"
    done
    ;;
  *)
    die "ERROR: unknown command 'pct ${cmd}'"
    ;;
esac
