"""A host's settings as both sides read them: their defaults, the rules a value must meet, the threshold's bounds.

The config checks a TOML file with these rules and the host agent checks each request with the same ones (the
agent's archive carries this file as `dynctl/base/hostspec.py`, like `dynctl/base/sglang.py`), so it is stdlib only and
runs on the agent's oldest interpreter (Python 3.9). Each check answers why a value is wrong, or None: the
caller says where the value came from (a file and key, a request) and which error that is on its side.
"""

from __future__ import annotations

import posixpath
import re

DEFAULT_WORKDIR = "~/.dynctl"
DEFAULT_PORT = 30000
DEFAULT_KEEP_HISTORY = 20  # finished releases and operation records a host keeps in its workdir
MAX_KEEP_HISTORY = 100_000

# The threshold: -1 never disables speculation, 0 disables it whenever a request runs, N above N running requests.
MIN_THRESHOLD = -1
MAX_THRESHOLD = 1_000_000

_HOME_PATH = re.compile(r"^~[A-Za-z0-9_.-]*(/|$)")  # ~, ~/x, ~user/x: a home on the host


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def workdir_problem(workdir) -> str | None:
    """Why `workdir` cannot be one, or None. One rule for every transport: absolute, or under the remote
    home as ~/...; a relative path would follow whatever directory dynctl happened to run in (the client's
    cwd locally, the login or container home over SSH and pct), so two shells could split a host's lock.
    Nor the home directory itself or /: dynctl keeps its lock, journal and agent copies in the workdir and
    cleans up after itself there."""
    if not isinstance(workdir, str):
        return "expected a path, got %r" % (workdir,)
    if not (workdir.startswith("/") or _HOME_PATH.match(workdir)):
        return "'%s' is relative: use an absolute path, or ~/... for the home directory on the host" % workdir
    norm = posixpath.normpath(workdir)
    if not norm.strip("/") or re.fullmatch(r"~[A-Za-z0-9_.-]*", norm):
        return ("'%s' is %s itself, where dynctl would keep its lock, journal and agent copies and clean up after "
                "itself: use a directory of its own, such as ~/.dynctl"
                % (workdir, "the root directory" if norm.startswith("/") else "the home directory"))
    return None


def port_problem(port) -> str | None:
    if not _integer(port) or not 0 < port < 65536:
        return "expected an integer 1-65535, got %r" % (port,)
    return None


def keep_history_problem(keep) -> str | None:
    if not _integer(keep) or not 1 <= keep <= MAX_KEEP_HISTORY:
        return ("expected how many finished releases and operation records to keep, an integer 1-%d, got %r"
                % (MAX_KEEP_HISTORY, keep))
    return None


def threshold_problem(value) -> str | None:
    """Why `value` (an int, or the text of one) is no threshold, or None."""
    if isinstance(value, bool):
        return "expected an integer, got %r" % (value,)
    if not _integer(value):
        if not re.fullmatch(r"[+-]?\d+", str(value).strip()):
            return ("%r is not an integer (use a whole number of requests, e.g. 32, or -1 to never disable "
                    "speculation)" % (value,))
        value = int(str(value).strip())
    if value < MIN_THRESHOLD:
        return "%d is below -1 (-1 means never disable speculation)" % value
    if value > MAX_THRESHOLD:
        return "%d is larger than %s running requests; use -1 to never disable speculation" % (
            value, "{:,}".format(MAX_THRESHOLD))
    return None


# --------------------------------------------------------------------------- the launch of a plain start

def configured_argv(launch, args, port) -> list:
    """The configured launch argv: the launch (`{python} -m sglang.launch_server`), the host's args, then the
    flags dynctl owns (SPEC §3)."""
    return list(launch) + list(args) + ["--port", str(port), "--enable-metrics"]


def plain_start(in_force, adopted, configured):
    """(argv, how, adopted) of a start or restart given no argv: the argv recorded with the release in force
    (what deploy started, so a start after a stop keeps the threshold), else the adopted server's launch
    (the baseline), else `configured`; `adopted` is returned when its launch is the one chosen.

    in_force: {"release", "argv"} of the release in force or None; adopted: {"argv", "pid", ...} or None.
    The agent decides with it under the host lock; the client previews the same decision before asking.
    """
    if in_force and in_force.get("argv"):
        return list(in_force["argv"]), "the launch argv of release %s" % in_force["release"], None
    why = ("release %s records none" % in_force["release"]) if in_force else "no release in force"
    if adopted and adopted.get("argv"):
        return (list(adopted["argv"]), "the adopted launch of pid %s, the baseline (%s)" % (adopted.get("pid"), why),
                adopted)
    if configured:
        return list(configured), "the configured launch argv (%s)" % why, None
    return None, None, None
