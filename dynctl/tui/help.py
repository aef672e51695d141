"""The `?` screen: every key of the dashboard, read from its bindings, so the list cannot drift from the keys."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, Static

from dynctl.live.snapshot import HostSnapshot

# what the footer's one word cannot say
_MORE = {
    "app.deploy": "deploy a threshold (asks for it, shows the plan's warnings, then confirms)",
    "app.rollback": "back to the previous release (confirms first)",
    "app.threshold": "change the threshold live, without a restart",
    "app.stop_server": "stop the server: drain, then SIGKILL after the grace (confirms first)",
    "app.start_server": "start the server with the release in force",
    "app.restart_server": "restart with the release's launch; a live threshold goes back (confirms first)",
    "app.bench": "concurrency sweep against the server",
    "app.switch_host(1)": "next host",
    "app.switch_host(-1)": "previous host",
    "toggle_log": "server log / actions panel",
    "full_log": "the full server log, every line, following new ones (f pauses)",
    "help": "this screen",
    "quit": "quit",
}


def key_rows(bindings: list[Binding]) -> list[tuple[str, str]]:
    """(keys, what they do) for each binding, in the order the dashboard declares them."""
    rows = []
    for b in bindings:
        keys = " / ".join("?" if k == "question_mark" else k for k in b.key.split(","))
        rows.append((keys, _MORE.get(b.action, b.description)))
    return rows


def source_rows(snap: HostSnapshot | None) -> list[str]:
    """One line per live number: its source and age ("tok/s  generation_tokens_total rate, 0 s")."""
    if snap is None:
        return []
    names = {"gen_throughput": "tok/s", "running_reqs": "batch", "queue_reqs": "queue", "token_usage": "KV",
             "accept_length": "accept", "speculation": "speculation", "threshold": "threshold", "gpus": "GPUs",
             "gpu_processes": "GPU procs"}
    out = []
    for key, label in names.items():
        reading = snap.readings.get(key)
        if reading is None:
            continue
        where = {"counter": "generation_tokens_total rate", "metrics": "gauge"}.get(reading.source, reading.source)
        age = "age unknown" if reading.age_s is None else f"{reading.age_s:.0f} s"
        out.append(f"  {label:<12} {where}, {age}" + ("  STALE" if reading.stale else ""))
    return out


class HelpScreen(ModalScreen[None]):
    """Keys and what they do; any of escape, q or ? closes it."""

    BINDINGS = [Binding("escape,q,question_mark", "close", "Close")]

    def __init__(self, bindings: list[Binding], read_only: bool = False, snapshot: HostSnapshot | None = None) -> None:
        super().__init__()
        self.rows = key_rows(bindings)
        self.read_only = read_only
        self.sources = source_rows(snapshot)

    def compose(self) -> ComposeResult:
        width = max(len(k) for k, _ in self.rows)
        text = "\n".join(f"{k:<{width}}  {what}" for k, what in self.rows)
        if self.read_only:
            text += "\n\nread-only: the keys that change a host are off"
        if self.sources:
            text += "\n\nwhere the numbers on screen come from, and how old they were at the last sample:\n"
            text += "\n".join(self.sources)
        with Vertical(id="dialog"):
            yield Label("dynctl keys", id="dialog-title")
            yield Static(text, id="help-keys")
            yield Label("escape, q or ? closes", id="dialog-prompt")

    def action_close(self) -> None:
        self.dismiss(None)
