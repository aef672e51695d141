"""What a server's launch says once its `--config file.yaml` is read: the port and the speculation settings.

sglang (0.5.x, srt/server_args_config_parser.py) merges the YAML's top-level `key: value` pairs in as
`--key value` flags placed before the command line's own, so a flag on the command line wins. The same
merge here: PyYAML where the host has it (sglang depends on it), else a reader of the flat mapping that
such a file is. Values are strings, as argparse would see them.
"""

from __future__ import annotations

import os

from dynctl import sglang

CONFIG_FLAG = "--config"


def flag_value(argv, flag):
    """The value of `flag` in argv (`--flag v` or `--flag=v`), the last one winning as in argparse; else None."""
    found = None
    for i, arg in enumerate(argv or []):
        if arg == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def read_config(path):
    """{flag: value} of a `--config` YAML (`--port`: "30001"); raises ValueError naming the file and line."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        import yaml
    except ImportError:
        data = _flat_yaml(text, path)
    else:
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ValueError("%s: not YAML: %s" % (path, err))
    if not isinstance(data, dict):
        raise ValueError("%s: expected a mapping of server arguments, got %s" % (path, type(data).__name__))
    out = {}
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            value = "true" if value else "false"
        out[flag] = value if isinstance(value, (list, dict)) else ("" if value is None else str(value))
    return out


def _flat_yaml(text, path):
    data = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        if not raw.strip() or raw.lstrip().startswith("#") or raw.strip() == "---":
            continue
        if raw[0] in " \t-":  # a nested value or list item: not a flag dynctl reads
            continue
        key, sep, value = raw.partition(":")
        if not sep:
            raise ValueError("%s line %d: expected `key: value`, got %r" % (path, lineno, raw))
        value = value.strip()
        if value[:1] in ("'", '"') and value[0] in value[1:]:
            value = value[1:value.index(value[0], 1)]
        else:
            value = value.split(" #", 1)[0].strip()
            if value.lower() in ("true", "yes", "on"):
                value = True
            elif value.lower() in ("false", "no", "off"):
                value = False
            elif value in ("", "~", "null"):
                value = None
        data[key.strip()] = value
    return data


def merged(argv, cwd=None):
    """argv's flags with its `--config` YAML merged in ({flag: value}; the command line wins), or None when the
    file cannot be read (the caller then knows only the command line)."""
    flags = {}
    path = flag_value(argv, CONFIG_FLAG)
    if path:
        if cwd and not os.path.isabs(path):
            path = os.path.join(cwd, path)
        try:
            flags.update(read_config(path))
        except (OSError, ValueError):
            return None
    for i, arg in enumerate(argv or []):
        if not arg.startswith("--") or arg == CONFIG_FLAG or arg.startswith(CONFIG_FLAG + "="):
            continue
        flag, eq, value = arg.partition("=")
        if eq:
            flags[flag] = value
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            flags[flag] = argv[i + 1]
        else:
            flags[flag] = "true"
    return flags


def server_port(argv, cwd=None):
    """The port a launch listens on: its `--port`, else its `--config` YAML's `port`, else sglang's default.
    None when a config file names no port on the command line and cannot be read."""
    port = flag_value(argv, "--port")
    if port is not None:
        return port
    if flag_value(argv, CONFIG_FLAG):
        flags = merged(argv, cwd)
        if flags is None:
            return None
        if flags.get("--port") not in (None, ""):
            return str(flags["--port"])
    return str(sglang.DEFAULT_PORT)
