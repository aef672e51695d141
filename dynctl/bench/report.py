"""The bench result as a JSON document (vLLM `bench serve` names per level) and as table rows."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from dynctl.bench.runner import BenchResult
from dynctl.base.errors import UsageError

SCHEMA = "dynctl.bench/1"


def result_document(result: BenchResult) -> dict[str, Any]:
    plan = result.plan
    probe = result.probe
    return {
        "schema": SCHEMA,
        "date": result.started,
        "host": result.host,
        "simulated": result.simulated,
        "backend": "sglang-oai",
        "endpoint": "/v1/completions",
        "model_id": probe.get("model"),
        "server_version": probe.get("version"),
        "speculative_algorithm": probe.get("speculative_algorithm"),
        "threshold_before": probe.get("threshold"),
        "debug_checks": result.debug_checks,  # [{"check", "source"}]: what slows the measured server
        "slower_than_production": bool(result.debug_checks),
        "input_len": plan.input_len,
        "output_len": plan.output_len,
        "ignore_eos": True,
        "duration_per_level_s": plan.duration,
        "num_prompts": plan.num_prompts,
        "num_warmups": plan.warmup,  # null: one warm-up request per worker
        "goodput_config": plan.goodput or None,
        "concurrency_levels": list(plan.concurrency),
        "interrupted": result.interrupted,
        "error": result.error,
        "runs": [
            {"mode": run.mode.name, "threshold": run.threshold_in_force, "label": run.mode.name,
             "measured_as": run.measured_as, "levels": run.levels}
            for run in result.runs
        ],
        "recommendation": result.recommendation,
    }


def write_json(result: BenchResult, path: str | os.PathLike[str]) -> Path:
    """Write the document atomically (temp file + rename): a Ctrl-C never leaves half a file."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"--json {target}: is a directory")
    text = json.dumps(result_document(result), indent=2, allow_nan=False, default=str) + "\n"
    directory = target.parent if str(target.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except OSError as err:
        raise UsageError(f"--json {target}: cannot write: {err.strerror or err}") from None
    return target


COLUMNS = (  # (header, cell): narrow enough for an 80-column terminal; the JSON has every statistic
    ("conc", lambda lv: str(lv["max_concurrency"])),
    ("tok/s", lambda lv: f"{lv['output_throughput']:.1f}"),
    ("req/s", lambda lv: f"{lv['request_throughput']:.2f}"),
    ("TTFT ms", lambda lv: f"{lv['median_ttft_ms']:.0f}/{lv['p99_ttft_ms']:.0f}"),
    ("TPOT ms", lambda lv: f"{lv['median_tpot_ms']:.1f}"),
    ("ITL p99", lambda lv: f"{lv['p99_itl_ms']:.1f}"),
    ("E2E ms", lambda lv: f"{lv['median_e2el_ms']:.0f}/{lv['p99_e2el_ms']:.0f}"),
    ("fail", lambda lv: str(lv["failed"])),
)


def level_headers(goodput: bool = False) -> list[str]:
    """TTFT and E2E cells read p50/p99; then goodput if asked, then the server's own view."""
    return [h for h, _ in COLUMNS] + (["goodput"] if goodput else []) + ["batch", "spec", "accept"]


def level_cells(level: dict[str, Any], goodput: bool = False) -> list[str]:
    cells = [cell(level) for _, cell in COLUMNS]
    if goodput:
        cells.append(_num(level.get("request_goodput"), "{:.2f}"))
    server = level.get("server") or {}
    cells.append(_num(server.get("mean_batch_size"), "{:.1f}"))
    share = server.get("spec_on_share")
    cells.append(_num(share * 100 if share is not None else None, "{:.0f}%"))
    cells.append(_num(level.get("accept_length"), "{:.2f}"))
    return cells


def comparison_rows(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    """Side by side: output tok/s per mode and level, the best mode per level marked with '*'."""
    headers = ["conc"] + [run.mode.name for run in result.runs]
    levels = sorted({lv["max_concurrency"] for run in result.runs for lv in run.levels})
    rows = []
    for c in levels:
        values = [next((lv["output_throughput"] for lv in run.levels if lv["max_concurrency"] == c), None)
                  for run in result.runs]
        best = max((v for v in values if v is not None), default=None)
        rows.append([str(c)] + ["-" if v is None else f"{v:.1f}{' *' if v == best and len(values) > 1 else ''}"
                                for v in values])
    return headers, rows


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)
