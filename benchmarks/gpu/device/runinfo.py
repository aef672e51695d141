"""What a GPU benchmark call stamps on every row it writes, and how a returned folder is checked for one call.

Stdlib only: phase.py imports it on the device, summarize.py here. A row carries `run_id` (one per call of
phase.py: `<UTC timestamp>-<pid>`), `phase`, `sglang` (the release measured) and `model` (the target's
shape, read from the generated model's config.json). summarize.py refuses a folder whose rows disagree on
any of these, so rows of two calls, two releases or two model shapes never land in one result file.
"""
from __future__ import annotations

import json
import os

# config.json key of make_models.py's target for each shape field
SHAPE_KEYS = (("hidden", "hidden_size"), ("layers", "num_hidden_layers"), ("heads", "num_attention_heads"),
              ("kv_heads", "num_key_value_heads"), ("inter", "intermediate_size"), ("vocab", "vocab_size"))
ROW_FIELDS = ("run_id", "phase", "sglang", "model")


def params_b(hidden, layers, heads, kv_heads, inter, vocab):
    """Parameters of the synthetic Llama target (untied embedding and lm_head, no biases), in billions."""
    head_dim = hidden // heads
    attention = 2 * hidden * hidden + 2 * kv_heads * head_dim * hidden
    layer = attention + 3 * hidden * inter + 2 * hidden
    return round((layers * layer + 2 * vocab * hidden + hidden) / 1e9, 2)


def shape_from_config(cfg):
    """The shape fields of a Llama config.json (a dict), params_b included."""
    missing = [key for _, key in SHAPE_KEYS if not isinstance(cfg.get(key), int)]
    if missing:
        raise ValueError("config.json has no integer %s" % ", ".join(missing))
    shape = {name: cfg[key] for name, key in SHAPE_KEYS}
    shape["params_b"] = params_b(**shape)
    return shape


def read_shape(model_dir):
    """The shape of the target under model_dir (model_dir/target/config.json)."""
    path = os.path.join(model_dir, "target", "config.json")
    with open(path) as f:
        try:
            return shape_from_config(json.load(f))
        except ValueError as err:
            raise ValueError("%s: %s" % (path, err)) from None


def parse_shape(text):
    """`hidden=4096,layers=32,heads=32,kv_heads=8,inter=11008,vocab=32000` (kv-heads also accepted) ->
    the shape dict; params_b is computed unless given. A bad or missing item raises ValueError naming it."""
    names = [name for name, _ in SHAPE_KEYS]
    shape = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in names + ["params_b"]:
            raise ValueError("%r: expected NAME=VALUE with NAME one of %s, params_b" % (item, ", ".join(names)))
        try:
            shape[key] = float(value) if key == "params_b" else int(value)
        except ValueError:
            raise ValueError("%r: %r is not a number" % (item, value)) from None
    missing = [n for n in names if n not in shape]
    if missing:
        raise ValueError("missing %s" % ", ".join(missing))
    shape.setdefault("params_b", params_b(**{n: shape[n] for n in names}))
    return {n: shape[n] for n in names + ["params_b"]}


def stamp(rows, run):
    """rows (dicts) with the run's fields added to each; `run` holds ROW_FIELDS."""
    return [dict(row, **{k: run[k] for k in ROW_FIELDS}) for row in rows]


def one_run(sweeps, version):
    """The run fields every row of sweeps ({label: [row, ...]}) shares, or ValueError saying what is mixed.

    Rows from before run ids were stamped carry none of the fields: a folder of only such rows gives
    None (nothing to check); such rows next to stamped ones are a mix."""
    seen = {k: {} for k in ROW_FIELDS}  # field -> {json value: first "label cN" carrying it}
    bare = []
    for label, rows in sorted(sweeps.items()):
        for row in rows:
            where = "%s c%s" % (label, row.get("concurrency"))
            if not any(k in row for k in ROW_FIELDS):
                bare.append(where)
                continue
            for k in ROW_FIELDS:
                seen[k].setdefault(json.dumps(row.get(k), sort_keys=True), where)
    if not any(seen.values()):
        return None
    if bare:
        raise ValueError("rows without a run id (%s) next to rows of run %s"
                         % (", ".join(bare[:4]), ", ".join(json.loads(v) or "?" for v in seen["run_id"])))
    for k, what in (("run_id", "run ids"), ("sglang", "releases"), ("model", "model shapes"),
                    ("phase", "phases")):
        if len(seen[k]) > 1:
            raise ValueError("rows of %d %s: %s" % (len(seen[k]), what, "; ".join(
                "%s (first in %s)" % (v, w) for v, w in seen[k].items())))
    run = {k: json.loads(next(iter(seen[k]))) for k in ROW_FIELDS}
    if run["sglang"] != version:
        raise ValueError("rows of sglang %s, not --version %s" % (run["sglang"], version))
    if not run["run_id"]:
        raise ValueError("rows without a run id")
    return run
