"""Pure render functions: one snapshot (and a width) in, one rich Text out. Dolphie's panel idea."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence

from rich.text import Text

from dynctl.base.parsers.nvidia_smi import GpuStat
from dynctl.base.parsers.serverlog import parse_decode_line, split_log_prefix
from dynctl.live.snapshot import GpuHolder, HostSnapshot
from dynctl.tui.chart import OFF_STYLE, ON_STYLE

STATE_STYLE = {
    "ready": "bold green",
    "starting": "bold yellow",
    "draining": "bold dark_orange",
    "unresponsive": "bold red",
    "down": "bold red",
    "unknown": "grey50",
}
DIM = "grey50"


def clock(t: float | None) -> str:
    return "—" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def duration(seconds: float | None) -> str:
    """Compact: 42s, 3m05s, 12m, 2h03m, 3d4h."""
    if seconds is None:
        return "—"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s" if s < 600 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def count(value: float | None) -> str:
    """Compact: 7, 2.5, 4,321, 81k, 1.2M."""
    if value is None:
        return "—"
    if value >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.1f}"


def render_header(snap: HostSnapshot | None, host: str, read_only: bool = False) -> Text:
    """host · sglang version · strategy · release · STATE up … · pid"""
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f" {host}", style="bold")
    if snap is not None and snap.simulated:
        t.append(" (simulated)", style="italic")
    if snap is None:
        t.append("  waiting for the first sample …", style=DIM)
        return t
    sep = (" · ", DIM)
    t.append_text(Text.assemble(sep, ("sglang ", DIM), snap.sglang_version or "?"))
    t.append_text(Text.assemble(sep, snap.strategy or "no patch"))
    if snap.release:
        t.append_text(Text.assemble(sep, ("rel ", DIM), snap.release))
    if snap.connected:
        t.append_text(Text.assemble(sep, (snap.state.upper(), STATE_STYLE.get(snap.state, ""))))
    else:
        t.append_text(Text.assemble(sep, (f"last seen {snap.state.upper()}", DIM)))
    if snap.uptime_s is not None:
        t.append(f" up {duration(snap.uptime_s)}", style=DIM)
    if snap.pid is not None:
        t.append_text(Text.assemble(sep, ("pid ", DIM), str(snap.pid)))
    if read_only:
        t.append("  [read-only]", style="bold magenta")
    return t


def host_style(snap: HostSnapshot | None) -> tuple[str, str]:
    if snap is None:
        return "○", DIM
    if not snap.connected:
        return "✕", "bold red"
    return "●", STATE_STYLE.get(snap.state, "")


def render_hosts(hosts: Sequence[str], current: str, latest: Mapping[str, HostSnapshot | None]) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(" hosts ", style=DIM)
    for name in hosts:
        dot, style = host_style(latest.get(name))
        t.append(f" {dot} ", style=style)
        t.append(name, style="bold reverse" if name == current else "")
    t.append("   h/tab: next", style=DIM)
    return t


def render_banner(snap: HostSnapshot | None, now: float) -> Text | None:
    """The one-line alarm above everything: disconnected, an operation holding the host, or something on
    the port that is not ours."""
    if snap is None:
        return None
    if not snap.connected:
        t = Text(no_wrap=True, overflow="ellipsis")
        since = snap.disconnected_since
        t.append(f" DISCONNECTED since {clock(since)}", style="bold")
        if since is not None:
            t.append(f" ({duration(now - since)})")
        if snap.retry_at is not None:
            wait = snap.retry_at - now
            t.append(f" · retry in {duration(wait)}" if wait > 0.5 else " · reconnecting …")
        if snap.error:
            t.append(f" · {snap.error}")
        return t
    if snap.operation:
        return Text(f" {snap.operation}", no_wrap=True, overflow="ellipsis")
    if snap.not_ours:
        return Text(f" NOT OURS: {snap.not_ours} (left alone)", no_wrap=True, overflow="ellipsis")
    if snap.leftovers:
        return Text(f" leftovers of the previous server alive: pids {', '.join(map(str, snap.leftovers))} "
                    "(stop sweeps them)", no_wrap=True, overflow="ellipsis")
    return None


_GLYPHS = {  # three-row letters for the big indicator on tall screens
    "O": ("█▀▀█", "█  █", "█▄▄█"),
    "N": ("█▄ █", "█ ▀█", "█  █"),
    "F": ("█▀▀▀", "█▀▀ ", "█   "),
    "?": ("▀▀▀█", " ▄▀▀", " ▄  "),
}


def speculation_word(snap: HostSnapshot | None) -> tuple[str, str]:
    """("ON" | "OFF" | "?" | "NONE", css class)."""
    if snap is None or snap.speculation is None and snap.spec_configured is not False:
        return "?", "unknown"
    if snap.spec_configured is False:
        return "NONE", "none"
    return ("ON", "on") if snap.speculation else ("OFF", "off")


def render_speculation(snap: HostSnapshot | None, width: int, height: int) -> Text:
    word, _ = speculation_word(snap)
    t = Text(justify="center", no_wrap=True, overflow="crop")
    big = height >= 7 and word in ("ON", "OFF", "?")
    if big:
        for row in range(3):
            t.append("  ".join(_GLYPHS[c][row] for c in word) + "\n", style="bold")
        t.append("SPECULATION\n", style="bold")
    else:
        label = "NO SPECULATION" if word == "NONE" else f"SPECULATION {word}"
        t.append(label + "\n", style="bold")
    if snap is None:
        t.append("waiting for data", style="italic")
        return t
    s = snap.last_switch
    if snap.spec_configured is False:
        t.append("no speculative algorithm\nconfigured on the server")
        return t
    if snap.idle and snap.connected:
        t.append("idle: the next request " + ("speculates" if snap.speculation else "does not speculate"))
    elif s is None:
        t.append("no switch seen yet")
    else:
        t.append(f"since {clock(s.time)} ({duration(snap.time - s.time)} ago)" if snap.connected
                 else f"last switch {clock(s.time)}")
        if s.batch_size is not None and height >= 3:
            op = "≤" if s.enabled else ">"
            t.append(f"\nbatch {s.batch_size} {op} threshold {s.threshold}" if s.threshold is not None
                     else f"\nbatch {s.batch_size}, threshold off")
    return t


def batch_bar(running: int | None, threshold: int | None, width: int) -> Text:
    """A bar of the batch size with the threshold as a ┃ mark; green at or below it, orange above."""
    t = Text(no_wrap=True, overflow="crop")
    if width < 3:
        return t
    r = running or 0
    scale = max(8, r * 1.15, (threshold or 0) * 2 if threshold and threshold > 0 else 0)
    filled = min(width, round(r / scale * width))
    mark = None if threshold is None or threshold < 0 else min(width - 1, round(threshold / scale * width))
    over = threshold is not None and threshold >= 0 and r > threshold
    for i in range(width):
        if i == mark:
            t.append("┃", style="bold white")
        elif i < filled:
            t.append("█", style=OFF_STYLE if over else ON_STYLE)
        else:
            t.append("░", style="grey30")
    return t


def _stale_mark(t: Text, snap: HostSnapshot | None, name: str) -> None:
    """" STALE 42s" after a number whose source is older than the live view may call live."""
    reading = snap.readings.get(name) if snap else None
    if reading is not None and reading.stale:
        t.append(f" STALE {reading.age_s:.0f}s ", style="bold yellow")


def render_load(snap: HostSnapshot | None, width: int) -> Text:
    """batch vs threshold bar; queue · KV · accept; gen tok/s · steps without speculation."""
    t = Text(no_wrap=True, overflow="ellipsis")
    s = snap
    running = s.running_reqs if s else None
    threshold = s.threshold if s else None
    thr = "off" if threshold is not None and threshold < 0 else count(threshold)
    head = f"batch {count(running):>4} "
    tail = f" thr {thr}"
    t.append("batch ", style=DIM)
    t.append(f"{count(running):>4} ", style="bold")
    t.append_text(batch_bar(running, threshold, max(3, width - len(head) - len(tail))))
    t.append(" thr ", style=DIM)
    t.append(thr, style="bold")
    if s and s.threshold is not None and s.release_threshold is not None and s.threshold != s.release_threshold:
        t.append(f" (release {s.release_threshold})", style="bold yellow")
    _stale_mark(t, s, "running_reqs")
    t.append("\n")
    t.append("queue ", style=DIM)
    t.append(count(s.queue_reqs if s else None), style="bold")
    t.append(" · KV ", style=DIM)
    usage = s.token_usage if s else None
    t.append("—" if usage is None else f"{usage * 100:.0f}%", style="bold")
    if s and s.used_tokens is not None and s.max_total_tokens:
        t.append(f" ({count(s.used_tokens)}/{count(s.max_total_tokens)} tok)", style=DIM)
    t.append(" · accept ", style=DIM)
    t.append("—" if not s or s.accept_length is None else f"{s.accept_length:.2f}", style="bold")
    t.append("\n")
    t.append("gen ", style=DIM)
    t.append(count(s.gen_throughput if s else None), style="bold")
    t.append(" tok/s", style=DIM)
    _stale_mark(t, s, "gen_throughput")
    if s and s.disabled_steps is not None:
        t.append(" · steps without spec ", style=DIM)
        t.append(count(s.disabled_steps), style="bold")
    if s and s.metrics_error and s.connected and s.state != "down":
        t.append(f" · metrics: {s.metrics_error}", style="yellow")
    if s and s.spec_warning:
        t.append(f" · ⚠ {s.spec_warning}", style="bold yellow")
    return t


def _bar(fraction: float | None, width: int, style: str) -> Text:
    t = Text(no_wrap=True)
    if fraction is None:
        return t.append("·" * width, style="grey30")
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    t.append("█" * full, style=style)
    if full < width:
        t.append("▏▎▍▌▋▊▉"[part - 1] if part else "░", style=style if part else "grey23")
        t.append("░" * (width - full - 1), style="grey23")
    return t


def _gib(mib: float | None) -> str:
    return "—" if mib is None else f"{mib / 1024:.0f}"


def render_gpus_compact(gpus: Sequence[GpuStat], width: int) -> Text:
    """Several GPUs per line (`0 87% 117/140G`) when one line each does not fit."""
    t = Text(no_wrap=True, overflow="crop")
    cell = 18
    per_line = max(1, width // cell)
    for n, g in enumerate(gpus):
        util = "—" if g.util_pct is None else f"{g.util_pct:.0f}%"
        t.append(f"{g.index:>2} ", style="bold")
        t.append(f"{util:>4} ", style="cyan")
        t.append(f"{_gib(g.mem_used_mib)}/{_gib(g.mem_total_mib)}G".ljust(cell - 8), style="magenta")
        if n % per_line == per_line - 1 and n != len(gpus) - 1:
            t.append("\n")
    return t


def render_gpus(gpus: Sequence[GpuStat], error: str | None, width: int, height: int,
                holders: Sequence[GpuHolder] = (), snap: HostSnapshot | None = None) -> Text:
    """One line per GPU: index, utilisation bar and %, memory bar and used/total GiB; then, in the lines
    left, the processes that hold GPU memory (GPU, pid, user, memory, command), as nvitop lists them.
    With `snap`, a reading older than the live view may call live is marked STALE with its age."""
    t = Text(no_wrap=True, overflow="crop")
    if not gpus:
        t.append(error or "no GPU data", style=DIM)
        return t
    if len(gpus) > height:
        t = render_gpus_compact(gpus, width)
        _stale_mark(t, snap, "gpus")
        return t
    show_name = width >= 70
    bar_w = max(3, min(20, (width - (38 if show_name else 26)) // 2))
    for g in gpus:
        util = g.util_pct
        t.append(f"{g.index:>2} ", style="bold")
        if show_name:
            t.append(f"{(g.name or '?').replace('NVIDIA ', '')[:11]:<11} ", style=DIM)
        t.append_text(_bar(None if util is None else util / 100, bar_w, "cyan"))
        t.append(f" {'—' if util is None else f'{util:.0f}%':>4} ")
        frac = g.mem_used_mib / g.mem_total_mib if g.mem_used_mib is not None and g.mem_total_mib else None
        t.append_text(_bar(frac, bar_w, "magenta"))
        t.append(f" {_gib(g.mem_used_mib)}/{_gib(g.mem_total_mib)} GiB")
        if g is gpus[0]:
            _stale_mark(t, snap, "gpus")
        t.append("\n")
    room = height - len(gpus) - 1
    if holders and room >= 1:
        t.append(f"{'GPU':>3} {'PID':>7} {'USER':<10} {'MEM':>6}  COMMAND", style=DIM)
        _stale_mark(t, snap, "gpu_processes")
        t.append("\n")
        for h in holders[:room]:
            gpu = "?" if h.gpu is None else str(h.gpu)
            t.append(f"{gpu:>3} {h.pid:>7} {(h.user or '?')[:10]:<10} {_gib(h.used_mib):>5}G  ")
            t.append(f"{h.command or '?'}\n", style=DIM)
    t.rstrip()
    return t


def shorten_decode(message: str) -> str:
    """sglang's "Decode batch, #running-req: …" with what matters first, so a narrow tail still shows it."""
    d = parse_decode_line(message) if message.startswith("Decode batch") else None
    if d is None:
        return message
    parts = [f"decode run {count(d.running_reqs)}", f"{count(d.gen_throughput)} tok/s"]
    if d.accept_length is not None:
        parts.append(f"acc {d.accept_length:.2f}")
    if d.token_usage is not None:
        parts.append(f"kv {d.token_usage * 100:.0f}%")
    parts.append(f"queue {count(d.queue_reqs)}")
    return " · ".join(parts)


# uvicorn's access line for a request that went fine: one per request, so it would bury everything else.
_ROUTINE_ACCESS = re.compile(r'INFO:\s+\S+ - "(?:GET|POST|HEAD) \S+ HTTP/[\d.]+" 2\d\d')


def is_routine(line: str) -> bool:
    """A line the dashboard's tail leaves out (`dynctl logs` shows everything)."""
    return _ROUTINE_ACCESS.search(line) is not None


def render_log_line(line: str, utc_offset: float | None = None) -> Text:
    """A server log line with sglang's `[date time TPn]` prefix shortened to the local time."""
    p = split_log_prefix(line, utc_offset)
    t = Text(no_wrap=True, overflow="crop")
    if p.time is not None:
        t.append(clock(p.time) + " ", style=DIM)
        if p.ranks:
            t.append(" ".join(f"{k}{v}" for k, v in p.ranks.items()) + " ", style=DIM)
    msg = shorten_decode(p.message)
    if "Speculation disabled" in msg:
        style = "bold " + OFF_STYLE
    elif "Speculation enabled" in msg:
        style = "bold " + ON_STYLE
    elif "Traceback" in msg or "Error" in msg or "ERROR" in msg:
        style = "bold red"
    elif "WARNING" in msg or "Warning" in msg:
        style = "yellow"
    elif msg.startswith(("decode", "Decode batch", "Prefill batch")):
        style = DIM
    else:
        style = ""
    t.append(msg, style=style)
    return t
