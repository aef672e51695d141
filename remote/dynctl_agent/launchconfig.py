"""What a server's launch says once its `--config file.yaml` is read: the port and the speculation settings.

sglang (0.5.x, srt/server_args_config_parser.py) puts the YAML's `key: value` pairs in place of
`--config FILE` as `--key value` flags ahead of the command line's own, so a flag on the command line wins
(dynctl.base.sglang.merge_config_args does the same).
"""

from __future__ import annotations

from dynctl.base import sglang


def flag_value(argv, flag):
    """The value of `flag` in argv (`--flag v` or `--flag=v`), the last one winning as in argparse; else None."""
    found = None
    for i, arg in enumerate(argv or []):
        if arg == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def merged_argv(argv, cwd=None):
    """argv with its `--config` file merged in as sglang merges it; None when the file cannot be read."""
    try:
        return sglang.merge_config_args(argv, cwd=cwd)
    except (OSError, ValueError):
        return None


def server_port(argv, cwd=None):
    """The port a launch listens on: its `--port`, else its `--config` YAML's `port`, else sglang's default.
    None when the launch names a config file that cannot be read (its port is then unknown)."""
    port = flag_value(argv, "--port")
    if port is not None or sglang.CONFIG_FLAG not in (argv or []):
        return port if port is not None else str(sglang.DEFAULT_PORT)
    merged = merged_argv(argv, cwd)
    if merged is None:
        return None
    port = flag_value(merged, "--port")
    return port if port is not None else str(sglang.DEFAULT_PORT)
