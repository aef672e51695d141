"""A host whose server is launched as `sglang serve --config server.yaml` (the console script of its environment,
the model and speculation settings in the YAML): deploy and rollback through that style, on a demo host.

The environment's `sglang` script runs the simulator, which parses `serve` and merges `--config` the way
sglang's own `prepare_server_args` does, so a flag missing from the YAML, or the threshold not reaching the
server, fails the deploy's read-back.
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from pathlib import Path

import psutil
import pytest

import dynctl
from dynctl.sim.hostsetup import demo_args
from demo_box import dynctl as run_dynctl
from demo_box import server_pid, session, write_config

pytestmark = pytest.mark.slow

REPO = Path(dynctl.__file__).resolve().parent.parent


def sglang_env(root: Path) -> Path:
    """An environment's bin/: `python3` (this interpreter) and the `sglang` console script, which runs the
    simulator from this checkout."""
    bindir = root / "bin"
    bindir.mkdir(parents=True)
    python = bindir / "python3"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    script = bindir / "sglang"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO)!r})\n"
                      "from dynctl.sim.server import main\nsys.exit(main(sys.argv[1:]))\n")
    for path in (python, script):
        path.chmod(0o755)
    return bindir


def yaml_of(args: list[str]) -> str:
    """The demo's launch arguments as a `--config` YAML (`--flag value` -> `flag: value`)."""
    lines, i = ["# the operator's server settings"], 0
    while i < len(args):
        lines.append(f"{args[i][2:]}: {args[i + 1]}")
        i += 2
    return "\n".join(lines) + "\n"


def serve_with_a_config_yaml(config: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The demo host of `config` launched as `sglang serve --config server.yaml`, the demo's arguments in the
    YAML: the bin folder of its environment, and the YAML."""
    entry = tomllib.loads(config.read_text())["hosts"]["box"]
    bindir = sglang_env(tmp_path / "env")
    yaml = tmp_path / "server.yaml"
    yaml.write_text(yaml_of(demo_args()))
    entry.update(python=str(bindir / "python3"), launch=[str(bindir / "sglang"), "serve"],
                 args=["--config", str(yaml)])
    entry["env"]["DYNCTL_SIM_TIME_SCALE"] = "20"
    write_config(config, {"box": entry}, default_host="box")
    return bindir, yaml


def test_deploy_and_rollback_through_sglang_serve_with_a_config_yaml(demo_box, tmp_path):
    config = demo_box(via="local")
    bindir, yaml = serve_with_a_config_yaml(config, tmp_path)
    port = session(config).host.port

    res = run_dynctl("deploy", "--threshold", "5", "--yes", "--soak", "0", config=config)
    assert res.returncode == 0, res.stdout + res.stderr
    cmd = psutil.Process(server_pid(config)).cmdline()
    assert cmd[1:] == [str(bindir / "sglang"), "serve", "--config", str(yaml), "--speculative-disable-batch-threshold",
                       "5", "--port", str(port), "--enable-metrics"]
    status = json.loads(run_dynctl("status", "--json", config=config).stdout)["server"]
    assert (status["state"], status["threshold"]) == ("ready", 5)  # read back from the server itself

    back = run_dynctl("rollback", "--yes", "--soak", "0", config=config)
    assert back.returncode == 0, back.stdout + back.stderr
    cmd = psutil.Process(server_pid(config)).cmdline()
    assert cmd[1:] == [str(bindir / "sglang"), "serve", "--config", str(yaml), "--port", str(port), "--enable-metrics"]
    status = json.loads(run_dynctl("status", "--json", config=config).stdout)["server"]
    assert status["state"] == "ready" and status["threshold"] is None
    assert os.path.isfile(yaml)


def test_native_deploy_reads_the_speculation_settings_from_the_config_yaml(demo_box, tmp_path):
    """sglang >= 0.5.14: the adaptive config needs the step count, which here only the YAML on the host holds."""
    config = demo_box("0.5.14", via="local", strategy="native")
    bindir, yaml = serve_with_a_config_yaml(config, tmp_path)

    dry = run_dynctl("deploy", "--threshold", "4", "--dry-run", "--json", config=config)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    argv = json.loads(dry.stdout)["launch_argv"]
    assert "--speculative-adaptive" in argv and "--speculative-num-steps" not in argv  # steps 3 come from the YAML
    res = run_dynctl("deploy", "--threshold", "4", "--yes", "--soak", "0", config=config)
    assert res.returncode == 0, res.stdout + res.stderr
    status = json.loads(run_dynctl("status", "--json", config=config).stdout)["server"]
    assert (status["state"], status["threshold"]) == ("ready", 4)

    yaml.rename(tmp_path / "gone.yaml")  # a file the host cannot read is named, and nothing changes
    dry = run_dynctl("deploy", "--threshold", "6", "--dry-run", config=config)
    assert dry.returncode == 3 and "--config cannot be read" in " ".join(dry.stderr.split())
