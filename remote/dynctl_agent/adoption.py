"""`dynctl adopt`: the operator's server becomes dynctl's in place, without a restart.

Its launch (argv, environment, cwd, interpreter, its own log file) becomes the baseline release; while that
very process runs (pid, start time, command line) it is the managed server (servers.adopted_in_place).
"""

from __future__ import annotations

from dynctl_agent import lock, releases, servers
from dynctl_agent.protocol import AgentError


def server_adopt(ctx, adopt=None):
    """Record the operator's server `adopt` ({"pid", "start"} as the operator was shown it) as the baseline."""
    with lock.host_lock(ctx, "adopt"):
        loc = servers.locate(ctx)
        server = loc["server"]
        if server is not None:
            return {"adopted": False, "pid": server["pid"], "source": server["source"],
                    "message": "pid %d on port %d is already dynctl's server (%s); nothing to adopt"
                               % (server["pid"], ctx.port, "adopted" if server["source"] == "adopted"
                                  else "started by dynctl")}
        if loc.get("operator") is None:
            found = servers.not_ours(ctx, loc)
            why = ("; %s -- %s" % (found["text"], found["hint"])) if found else ""
            raise AgentError("adopt: no sglang server listens on port %d%s; nothing was changed" % (ctx.port, why),
                             "preflight")
        taking = servers.takeover(ctx, loc, "adopt", adopt)
        if taking is None:
            raise AgentError("adopt: the operator's word for pid %d is missing ({\"pid\", \"start\"}); nothing was "
                             "changed" % loc["operator"]["pid"], "usage")
        launch = servers.adoption(ctx, taking)
        releases.record_adopted(ctx, launch)
        return {"adopted": True, "pid": launch["pid"], "argv": launch["argv"], "cwd": launch["cwd"],
                "env_keys": sorted(launch["env"]), "log": launch["log"], "python": launch["python"]}
