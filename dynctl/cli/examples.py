"""One example per command, shown at the end of its --help: the line an operator would type first."""

from __future__ import annotations

from typing import Any

EXAMPLES = {
    "demo": "dynctl demo --no-tui",
    "deploy": "dynctl deploy --threshold 5 --host glm5 --dry-run",
    "rollback": "dynctl rollback --to baseline --host glm5",
    "releases": "dynctl releases --host glm5 | cut -f1,5",
    "threshold": "dynctl threshold 8 --host glm5",
    "hosts": "dynctl hosts",
    "status": "dynctl status --host glm5 --json",
    "stop": "dynctl stop --host glm5 --grace 120",
    "start": "dynctl start --host glm5",
    "restart": "dynctl restart --host glm5 --keep-live-threshold",
    "logs": "dynctl logs -f -n 50 --host glm5",
    "adopt": "dynctl adopt --host glm5",
    "tui": "dynctl tui --host glm5",
    "bench": "dynctl bench --host glm5 --concurrency 1,4,16,64 --json",
    "config": "dynctl config --host glm5",
    "patch status": "dynctl patch status --host glm5",
    "patch diff": "dynctl patch diff --host glm5",
    "patch apply": "dynctl patch apply --threshold 5 --host glm5",
    "patch revert": "dynctl patch revert --host glm5",
    "ops follow": "dynctl ops follow --host glm5",
    "ops list": "dynctl ops list --host glm5",
    "ops rollouts": "dynctl ops rollouts -n 5",
}


def add_examples(command: Any, prefix: str = "") -> Any:
    """Append `Example: ...` to the help of every command of `command` that has one and does not say it yet."""
    for name, sub in getattr(command, "commands", {}).items():
        example = EXAMPLES.get(prefix + name)
        if example and "Example:" not in (sub.help or ""):
            sub.help = (sub.help or "").rstrip() + f"\n\nExample: {example}"
        add_examples(sub, prefix + name + " ")
    return command
