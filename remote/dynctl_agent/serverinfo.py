"""/server_info of our server, the threshold read back from it, and the live threshold change."""

from __future__ import annotations

import json

from dynctl.base import hostspec, sglang
from dynctl_agent import httpclient, lock, releases, servers, store
from dynctl_agent.protocol import AgentError

STATE_FILE = "state.json"


def server_info(ctx, timeout=5.0):
    """/server_info of the managed server on this host, as a dict (or None when it does not answer)."""
    try:
        info = httpclient.server_info("127.0.0.1", ctx.port, timeout, keys=servers.api_keys(ctx))
    except httpclient.FAILURES:
        return None
    return info if isinstance(info, dict) else None


def threshold_in_force(info):
    """The runtime threshold (internal_states carry runtime updates; top-level keys are the launch copy)."""
    return sglang.threshold_in_force(info or {})


def adaptive_threshold(info):
    """(threshold, problem) a native server enforces, derived from what its /server_info reports: the adaptive
    config file it names and the batch sizes it pads to. (None, why) when that cannot be told; -1 when its
    config speculates at every batch size; (None, None) when the server runs without --speculative-adaptive."""
    info = info or {}
    if not info.get("speculative_adaptive"):
        return None, None
    path = info.get("speculative_adaptive_config")
    if not path:
        return None, "it runs with --speculative-adaptive but reports no --speculative-adaptive-config"
    try:
        with open(str(path), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        return None, "its adaptive config %s cannot be read: %s" % (path, getattr(err, "strerror", None) or err)
    cut = sglang.adaptive_cut(config if isinstance(config, dict) else {}, sglang.adaptive_pad_sizes(info))
    if cut is None:
        return None, "its adaptive config %s does not switch speculation off at one batch size" % path
    return cut, None


def server_info_verb(ctx):
    return {"info": server_info(ctx), "state": store.read_json(ctx.path(STATE_FILE)) or {},
            "current": releases.current(ctx)}


def set_threshold(ctx, threshold, host="127.0.0.1", port=None, timeout=10.0):
    """Set the speculation threshold live, then read back what every scheduler has in force.

    Under the host lock: a change during another operation (a deploy's soak, say) would make that
    operation report a threshold that is no longer the one in force.
    """
    problem = hostspec.threshold_problem(threshold) if isinstance(threshold, int) else (
        "expected an integer, got %r" % (threshold,))
    if problem:
        raise AgentError("threshold: %s; nothing was changed" % problem, "usage")
    with lock.host_lock(ctx, "threshold %d" % threshold):
        return _set_threshold(ctx, threshold, host, port, timeout)


def _set_threshold(ctx, threshold, host, port, timeout):
    port = int(port or ctx.port)
    if port == ctx.port:  # never send a change to a listener that is not our server
        loc = servers.locate(ctx)
        found = servers.not_ours(ctx, loc) if loc["server"] is None else None
        if found is not None and found["kind"] in ("foreign", "hidden"):
            raise AgentError("%s; the threshold was not sent (%s)" % (found["text"], found["hint"]), "preflight",
                             not_ours=found["text"])
    where = "%s:%d" % (host, port)
    keys = servers.api_keys(ctx) if port == ctx.port else None
    try:
        httpclient.post_json(host, port, sglang.SET_INTERNAL_STATE, sglang.set_threshold_body(threshold), timeout,
                             keys=keys)
    except httpclient.FAILURES as err:
        if httpclient.is_refused(err):
            # Nothing was sent, so nothing changed ("down": exit 3), unlike a request that failed half-way.
            raise AgentError("no server is listening on %s, so there is no live threshold to change; start "
                             "it (dynctl start), or deploy the threshold (dynctl deploy --threshold %d), which "
                             "starts it" % (where, threshold), "down") from None
        raise AgentError("server at %s: cannot change the threshold: %s %s"
                         % (where, sglang.SET_INTERNAL_STATE, httpclient.describe(err, timeout)), "failed") from None
    try:
        info = httpclient.server_info(host, port, timeout, keys=keys)
    except httpclient.FAILURES as err:
        raise AgentError("server at %s took the threshold change, but reading it back failed: /server_info %s"
                         % (where, httpclient.describe(err, timeout)), "failed") from None
    in_force = sglang.thresholds_in_force(info)
    if not in_force:  # /set_internal_state answers "updated" even for keys it ignores: trust the read-back
        raise AgentError("server at %s has no %s in /server_info internal_states: it is not patched, so "
                         "the threshold cannot change live" % (where, sglang.THRESHOLD_KEY), "preflight")
    if any(v != threshold for v in in_force):
        raise AgentError("server at %s did not take threshold %d: in force %s (is the running server the "
                         "patched release?)" % (where, threshold, in_force), "failed")
    store.journal(ctx, "threshold.set", threshold=threshold)
    return {"threshold": threshold, "in_force": in_force}
