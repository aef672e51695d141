"""What dynctl knows about SGLang, in one place: names, endpoints, rules it copies from sglang's source.

Used by the client, the simulator and the host agent (the agent's archive carries this file as
`dynctl/base/sglang.py`), so it is stdlib only and runs on the agent's oldest interpreter (Python 3.9).
"""

from __future__ import annotations

import difflib
import os
import re

# --------------------------------------------------------------------------- the threshold

THRESHOLD_FLAG = "--speculative-disable-batch-threshold"
THRESHOLD_KEY = "speculative_disable_batch_threshold"  # server_args field and internal_states key
ADAPTIVE_FLAG = "--speculative-adaptive"
ADAPTIVE_CONFIG_FLAG = "--speculative-adaptive-config"

LAUNCH_MODULE = "sglang.launch_server"
DEFAULT_PORT = 30000  # what sglang listens on without --port

# /server_info was /get_server_info before the rename; a server answers one of them.
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
SET_INTERNAL_STATE = "/set_internal_state"
LOADS_PATH = "/v1/loads?include=core"  # sglang >= 0.5.8: the scheduler's batch right now


def set_threshold_body(threshold: int) -> dict:
    """The /set_internal_state request that changes the threshold (the patch puts it in the allow-list)."""
    return {"server_args": {THRESHOLD_KEY: threshold}}


def thresholds_in_force(info: dict) -> list:
    """The threshold each scheduler reports in /server_info internal_states (runtime updates land there;
    the top-level key is the launch copy); empty on a server that is not patched."""
    states = (info or {}).get("internal_states") or []
    return [s.get(THRESHOLD_KEY) for s in states if isinstance(s, dict) and THRESHOLD_KEY in s]


def threshold_in_force(info: dict):
    found = thresholds_in_force(info)
    return found[0] if found else None


def adaptive_pad_sizes(info: dict):
    """The batch sizes a native (--speculative-adaptive) server pads a decode batch to before it picks a config
    slot, from what its /server_info reports; None when it does not pad (CUDA graphs off, or no padding)."""
    info = info or {}
    graphs = info.get("cuda_graph_config") if isinstance(info.get("cuda_graph_config"), dict) else {}
    decode = graphs.get("decode") if isinstance(graphs.get("decode"), dict) else {}
    if info.get("disable_cuda_graph") or info.get("disable_cuda_graph_padding") or decode.get("backend") == "disabled":
        return None
    for sizes in (info.get("cuda_graph_bs_decode"), decode.get("bs"), info.get("cuda_graph_bs")):
        if isinstance(sizes, list) and sizes and all(isinstance(b, int) and not isinstance(b, bool) for b in sizes):
            return sorted(set(sizes))
    return None


def adaptive_cut(config: dict, pad=None):
    """The threshold an adaptive config enforces: the largest T with speculation at every batch size up to T
    and none at T+1 (AdaptiveSpeculativeParams._route: pad to a captured size, then the largest key at or below
    it; the slot's first candidate is its starting steps). -1: speculation at every batch size; None: the
    config does not cut speculation off at one batch size (it is not one dynctl writes)."""
    import bisect

    slots = {}
    for key, entry in (config or {}).items():
        steps = entry.get("candidate_steps") if isinstance(entry, dict) else None
        if str(key).isdigit() and isinstance(steps, list) and steps:
            slots[int(key)] = steps
    if not slots:
        return None
    keys, pad = sorted(slots), sorted(pad) if pad else None

    def steps_at(bs):
        if pad is not None:
            i = bisect.bisect_left(pad, bs)
            bs = pad[i] if i < len(pad) else bs
        j = bisect.bisect_right(keys, bs) - 1
        return slots[keys[max(0, j)]]

    top = max(keys[-1], pad[-1] if pad else 0) + 1
    routed = [steps_at(bs) for bs in range(1, top + 1)]
    if any(len(set(s)) > 1 for s in routed):
        return None  # a slot that adapts its steps: no fixed cut
    on = [s[0] > 0 for s in routed]
    if all(on):
        return -1
    cut = on.index(False)
    return cut if not any(on[cut:]) else None


# /server_info keys the live view shows, and the first scheduler's internal_states it reads
SERVER_INFO_KEYS = ("version", "model_path", "served_model_name", "tp_size", "dp_size", "enable_dp_attention",
                    "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                    "speculative_num_draft_tokens", THRESHOLD_KEY, "speculative_adaptive",
                    "max_running_requests", "disable_overlap_schedule")
INTERNAL_STATE_KEYS = (THRESHOLD_KEY, "avg_spec_accept_length", "last_gen_throughput",
                       "effective_max_running_requests_per_dp")

# /metrics series bench samples during a level (sample names, counters with their _total)
BENCH_SERIES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput",
                "sglang:spec_accept_length", "sglang:spec_enabled", "sglang:spec_disable_threshold",
                "sglang:spec_disabled_steps_total", "sglang:generation_tokens_total",
                "sglang:cuda_graph_passes_total", "sglang:realtime_tokens_total")




def metric_lines(text: str, names=None) -> str:
    """The sglang: series of a /metrics text with their TYPE lines, without histogram buckets (nobody here
    reads them); only the series named in `names` when given (sample names, as BENCH_SERIES)."""
    keep = []
    for line in text.splitlines():
        if line.startswith("sglang:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name.endswith("_bucket") or name.endswith("_created"):
                continue
            if names is None or name in names:
                keep.append(line)
        elif line.startswith("# TYPE sglang:"):
            keep.append(line)
    return "\n".join(keep) + "\n"


# --------------------------------------------------------------------------- API keys

API_KEY_FLAG = "--api-key"
ADMIN_API_KEY_FLAG = "--admin-api-key"
SECRET_FLAGS = (API_KEY_FLAG, ADMIN_API_KEY_FLAG)
REDACTED = "***"
# AuthLevel.ADMIN_OPTIONAL endpoints (http_server.py): the admin key when the server has one, else the API key
ADMIN_PATHS = ("/set_internal_state", "/flush_cache")
_SECRET_IN_TEXT = re.compile(r"(--(?:admin-)?api-key)(=|\s+)(?:'[^']*'|\"[^\"]*\"|\S+)")
# the server's own `server_args=ServerArgs(..., api_key='...')` log line, and /server_info as JSON text
_SECRET_FIELD_IN_TEXT = re.compile(r"""(\b(?:admin_)?api_key=|"(?:admin_)?api_key":\s*)(['"])(?:(?!\2).)*\2""")
SECRET_FIELDS = ("api_key", "admin_api_key")


def api_keys(argv) -> dict:
    """{"api_key", "admin_api_key"} a server argv passes (later flags win, like argparse); {} without them."""
    keys = {}
    args = [a for a in (argv or []) if isinstance(a, str)]
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if flag in SECRET_FLAGS:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
            if value:
                keys[flag[2:].replace("-", "_")] = value
    return keys


def bearer_for(keys, path: str):
    """The key to send with a request for `path` to a server started with `keys` (sglang utils/auth.py
    decide_request_auth): none for /health* and /metrics, which are always open; the admin key (else the
    API key) for the admin endpoints; the API key for every other one."""
    if not keys:
        return None
    path = path.split("?", 1)[0]
    if path.startswith("/health") or path.startswith("/metrics"):
        return None
    if path in ADMIN_PATHS:
        return keys.get("admin_api_key") or keys.get("api_key")
    return keys.get("api_key")


def redact_argv(argv) -> list:
    """argv with the values of --api-key and --admin-api-key (either spelling) replaced by ***."""
    out, hide = [], False
    for arg in argv or []:
        if hide and isinstance(arg, str):
            out.append(REDACTED)
            hide = False
            continue
        hide = False
        flag, eq, _ = arg.partition("=") if isinstance(arg, str) else ("", "", "")
        if flag in SECRET_FLAGS:
            out.append(flag + "=" + REDACTED if eq else arg)
            hide = not eq
        else:
            out.append(arg)
    return out


def redact(value):
    """A record (str, list, dict, nested) with every secret flag's value replaced by ***, for what is shown
    or written down: journal, operation records, events, the live view."""
    if isinstance(value, str):
        value = _SECRET_IN_TEXT.sub(lambda m: m.group(1) + m.group(2) + REDACTED, value)
        return _SECRET_FIELD_IN_TEXT.sub(lambda m: m.group(1) + m.group(2) + REDACTED + m.group(2), value)
    if isinstance(value, (list, tuple)):
        items = redact_argv(list(value)) if any(isinstance(v, str) for v in value) else list(value)
        return [redact(v) for v in items]
    if isinstance(value, dict):
        return {k: REDACTED if k in SECRET_FIELDS and isinstance(v, str) and v else redact(v)
                for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- server defaults and rules

SPEC_DEFAULT_MAX_RUNNING = 48  # sglang's default --max-running-requests with speculative decoding


def cuda_graph_batch_sizes(max_bs: int, speculative: bool) -> list:
    """The decode batch sizes sglang captures CUDA graphs for, up to max_bs
    (ServerArgs._generate_cuda_graph_batch_sizes: a finer grid when speculating)."""
    if speculative:
        sizes = (list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4)) + list(range(72, 257, 8))
                 + list(range(272, max_bs + 1, 16)))
    else:
        sizes = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + list(range(512, max_bs + 1, 32))
    return [bs for bs in sizes if bs <= max_bs]


# --------------------------------------------------------------------------- versions and installs

_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post\d+)?$")


def parse_version(version: str):
    """(major, minor, patch) of a final release (`.postN` allowed), else None."""
    m = _RELEASE.match(str(version).strip())
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def version_tuple(version: str) -> tuple:
    """The leading numbers of any version string, for ordering (`0.5.14rc1` -> (0, 5, 14))."""
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def installed_version(package_dir: str):
    """The version of the sglang package at package_dir: its dist-info's, else the one its source declares."""
    parent = os.path.dirname(package_dir)
    try:
        infos = sorted(n for n in os.listdir(parent) if n.startswith("sglang-") and n.endswith(".dist-info"))
    except OSError:
        infos = []
    for name in infos:
        try:
            with open(os.path.join(parent, name, "METADATA"), encoding="utf-8", errors="replace") as f:
                m = re.search(r"^Version:\s*(\S+)", f.read(), re.M)
        except OSError:
            continue
        if m:
            return m.group(1)
    for source in ("version.py", "_version.py"):
        try:
            with open(os.path.join(package_dir, source), encoding="utf-8") as f:
                m = re.search(r"^(?:__version__|version)\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
        except OSError:
            continue
        if m:
            return m.group(1)
    return None


def find_installed():
    """{"package_dir", "version"} of the sglang this interpreter would import, or None; sglang is not imported
    (find_spec on a top-level name locates the package without running its __init__)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    package_dir = list(spec.submodule_search_locations)[0]
    return {"version": installed_version(package_dir), "package_dir": package_dir}


# --------------------------------------------------------------------------- nvidia-smi

# The index first: a looping query's output is cut into one block per period where it starts over.
GPU_QUERY = ("index", "uuid", "name", "utilization.gpu", "memory.used", "memory.total")
# uuid and pid before the process name, which may hold commas
APPS_QUERY = ("gpu_uuid", "pid", "process_name", "used_memory")
CSV_FORMAT = "--format=csv,noheader,nounits"


def gpu_query_argv(smi: str = "nvidia-smi") -> list:
    return [smi, "--query-gpu=" + ",".join(GPU_QUERY), CSV_FORMAT]


def apps_query_argv(smi: str = "nvidia-smi") -> list:
    return [smi, "--query-compute-apps=" + ",".join(APPS_QUERY), CSV_FORMAT]


# --------------------------------------------------------------------------- --config file.yaml

CONFIG_FLAG = "--config"


def read_config_yaml(path):
    """The mapping of a `--config` YAML, as sglang reads it (PyYAML's safe_load where it imports, else a reader
    of the flat `key: value` mapping such a file is); raises ValueError naming the file (and line)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        import yaml
    except ImportError:
        data = _flat_yaml(text, path)
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError("%s: not YAML: %s" % (path, err))
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError("%s: a config file must hold a mapping of server arguments, not %s"
                         % (path, type(data).__name__))
    return data


def _flat_yaml(text, path):
    data = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        if not raw.strip() or raw.lstrip().startswith("#") or raw.strip() == "---":
            continue
        if raw[0] in " \t-":  # a nested value or list item: no server flag dynctl reads is one
            continue
        key, sep, value = raw.partition(":")
        if not sep:
            raise ValueError("%s line %d: expected `key: value`, got %r" % (path, lineno, raw))
        value = value.strip()
        if value[:1] in ("'", '"') and value[0] in value[1:]:
            value = value[1:value.index(value[0], 1)]
        else:
            value = value.split(" #", 1)[0].strip()
            lower = value.lower()
            if lower in ("true", "yes", "on"):
                value = True
            elif lower in ("false", "no", "off"):
                value = False
            elif value in ("", "~", "null"):
                value = None
        data[key.strip()] = value
    return data


def config_args(data, store_true=()):
    """The flags sglang puts in place of `--config FILE` (srt/server_args_config_parser.py ConfigArgumentMerger):
    `--key value` with the key as written; a store_true flag only when true; lists as several values."""
    args = []
    for key, value in data.items():
        if isinstance(value, bool):
            if key.replace("-", "_") in store_true:
                args += ["--%s" % key] if value else []
            else:
                args += ["--%s" % key, str(value).lower()]
        elif isinstance(value, list):
            args += (["--%s" % key] + [str(v) for v in value]) if value else []
        else:
            args += ["--%s" % key, str(value)]
    return args


def merge_config_args(argv, store_true=(), cwd=None):
    """argv with its `--config FILE` replaced by the file's flags, placed first so the command line wins."""
    argv = list(argv)
    if CONFIG_FLAG not in argv:
        return argv
    at = argv.index(CONFIG_FLAG)
    if at + 1 >= len(argv):
        raise ValueError("No config file specified after --config flag!")
    path = argv[at + 1]
    if cwd and not os.path.isabs(path):
        path = os.path.join(cwd, path)
    return config_args(read_config_yaml(path), store_true) + argv[:at] + argv[at + 2:]


# --------------------------------------------------------------------------- the flags dynctl sets itself

# flag: how many values it takes; a deploy sets these anew on whatever launch it builds on
OWN_LAUNCH_FLAGS = {THRESHOLD_FLAG: 1, ADAPTIVE_CONFIG_FLAG: 1, ADAPTIVE_FLAG: 0, "--port": 1, "--enable-metrics": 0}


def without_flags(argv, flags):
    """argv without `flags` ({flag: number of values}), in both `--flag v` and `--flag=v` spellings."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        flag, eq, _ = arg.partition("=")
        if flag in flags:
            skip = 0 if eq else flags[flag]
            continue
        out.append(arg)
    return out


def same_launch(argv, other):
    """argv and other are one launch but for the flags dynctl sets itself (port, metrics, threshold, adaptive)."""
    return without_flags(argv, OWN_LAUNCH_FLAGS) == without_flags(other, OWN_LAUNCH_FLAGS)


def argv_diff(running: list[str], wanted: list[str]) -> str:
    """What differs between two argv: "-`--tp 8` +`--tp 4`" (- only in the running one, + only in `wanted`)."""
    parts = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, running, wanted, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            parts.append("-`" + " ".join(running[i1:i2]) + "`")
        if tag in ("replace", "insert"):
            parts.append("+`" + " ".join(wanted[j1:j2]) + "`")
    return " ".join(parts) or "none"
