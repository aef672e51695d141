"""The verbs of `dynctl bench`: probe the server, run one closed-loop level of the load generator.

The load generator of `dynctl bench` runs here, next to the server: its timings are the server's and
not the SSH path's, and 256 streams cost one SSH channel, not 256 forwarded ones. Measured with
benchmarks/bench_loadgen.py at 256 streams: here ~7 % of a core at 5,000 tok/s (0.8 % at the seed box's
speed) and 0.1 % on the client; through a local forward 58 % of a client core and failed requests.
Closed loop: each of C workers keeps one HTTP/1.1 connection and sends its next streaming
/v1/completions request when the previous one has ended. Raw timings go back to the client, which
computes the statistics (dynctl/bench/stats.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import resource

from dynctl.base import sglang
from dynctl_agent import httpclient, procfs, servers
from dynctl_agent.loadgen import Level
from dynctl_agent.protocol import AgentError

# Checks sglang can run on every busy step that make a server slower than it runs in production.
STRICT_MEM_ENV = "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"  # an int in some releases, a bool in others
NAN_FLAG = "--enable-nan-detection"
_ENV_OFF = ("", "0", "false", "no", "n", "off")


def _server_process(ctx, port):
    """(pid, argv) of the server answering on port: the one locate() names, else the port's listener."""
    if port == int(ctx.port):
        found = servers.locate(ctx)["server"]
        if found is not None:
            return found["pid"], found["argv"]
    for pid in procfs.listening_pids(port):
        return pid, procfs.cmdline(pid)
    return None, []


def debug_checks(ctx, port, info):
    """The slowing debug checks the server runs with, from its environment and command line (/proc).

    {"checks": [{"check", "source"}], "pid": the process read or None, "environ_read": bool}
    """
    pid, argv = _server_process(ctx, port)
    try:
        env = procfs.environ(pid) if pid else None
    except OSError:
        env = None
    checks = []
    value = (env or {}).get(STRICT_MEM_ENV)
    if value is not None and value.strip().lower() not in _ENV_OFF:
        checks.append({"check": "strict memory checks", "source": "%s=%s in its environment" % (STRICT_MEM_ENV, value)})
    if NAN_FLAG in argv:
        checks.append({"check": "NaN detection", "source": "%s on its command line" % NAN_FLAG})
    elif info.get("enable_nan_detection") is True:
        checks.append({"check": "NaN detection", "source": "enable_nan_detection in its /server_info"})
    return {"checks": checks, "pid": pid, "environ_read": env is not None}


def bench_probe(ctx, host="127.0.0.1", port=None, timeout=10.0, checks=True):
    """Is the server answering, which model, which speculation, is the threshold live-switchable, and
    (unless checks is false) which slowing debug checks it runs with."""
    port = int(port or ctx.port)
    where = "%s:%d" % (host, port)
    keys = servers.api_keys(ctx) if port == ctx.port else None
    try:
        models = httpclient.get_json(host, port, "/v1/models", timeout, keys=keys)
        info = httpclient.server_info(host, port, timeout, keys=keys)
    except httpclient.FAILURES as err:
        return {"reachable": False, "where": where, "error": httpclient.short(err)}
    data = models.get("data") or [{}]
    thresholds = sglang.thresholds_in_force(info)
    try:
        metrics = "sglang:" in httpclient.get(host, port, "/metrics", timeout).decode("utf-8", "replace")
    except httpclient.FAILURES:
        metrics = False
    out = {
        "reachable": True,
        "where": where,
        "model": data[0].get("id"),
        "version": info.get("version"),
        "speculative_algorithm": info.get("speculative_algorithm"),
        "threshold": thresholds[0] if thresholds else None,
        "threshold_live": bool(thresholds),
        "metrics": metrics,
        # a server without a tokenizer takes token ids on /generate, not text on /v1/completions
        "token_ids": bool(info.get("skip_tokenizer_init")),
    }
    if checks:
        found = debug_checks(ctx, port, info)
        out["debug_checks"] = found["checks"]
        out["debug_checks_read"] = {"pid": found["pid"], "environ": found["environ_read"]}
    return out


def _cpu_s():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def bench_level(ctx, concurrency, input_len, output_len, duration=None, num_prompts=None, warmup=None,
                model=None, seed=0, host="127.0.0.1", port=None, tick_s=1.0, sample_s=0.5,
                idle_timeout=300.0, max_level_s=None):
    """Run one closed-loop level; yield a tick about every tick_s, then the raw level result."""
    port = int(port or ctx.port)
    for name, value in (("concurrency", concurrency), ("input_len", input_len), ("output_len", output_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise AgentError("%s must be a positive integer, got %r" % (name, value), "usage")
    if (duration is None) == (num_prompts is None):
        raise AgentError("give exactly one of duration and num_prompts", "usage")
    warmup = concurrency if warmup is None else int(warmup)
    if max_level_s is None:
        max_level_s = 3600.0 + (duration or 0)
    probe = bench_probe(ctx, host=host, port=port, checks=False)
    if not probe["reachable"]:
        raise AgentError("server at %s not answering: %s" % (probe["where"], probe["error"]), "unreachable")
    level_args = (host, port, model or probe["model"], concurrency, input_len, output_len, duration, num_prompts,
                  warmup, seed, sample_s, idle_timeout, max_level_s, probe["token_ids"],
                  sglang.bearer_for(servers.api_keys(ctx) if port == ctx.port else None, "/generate"))
    loop = asyncio.new_event_loop()
    try:
        level = loop.run_until_complete(_make_level(level_args))
        cpu0 = _cpu_s()
        task = loop.create_task(level.run())
        # The loop only runs inside run_until_complete: between slices we write one small tick line.
        while not task.done():
            loop.run_until_complete(asyncio.wait([task], timeout=tick_s))
            if not task.done():
                yield level.tick()
        task.result()
        yield level.result(_cpu_s() - cpu0)
    finally:
        with contextlib.suppress(Exception):  # streams cut mid-body leave response generators open
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _make_level(args):
    return Level(*args)  # built inside the loop: its Events bind to it on Python < 3.10
