"""Transport costs on loopback against a real OpenSSH sshd (tests/sshd_harness.py) and the pct stand-in.

  connect        fresh SSH connection: TCP + key exchange + ed25519 auth (+ TCP_NODELAY); also
                 through one ProxyJump host (two logins, the second inside a direct-tcpip channel)
  exec           `true` on an open connection (one channel: open, exec, exit status)
  pct exec       `true` through `pct exec` (constant sh -c wrapper with the exit-status sentinel)
  agent ping     AgentClient(...).call("ping"): one remote python start + JSON round trip, via
                 Local (reference: the interpreter's own start-up), SSH, and SSH + pct
  status logins  SSH logins the sshd accepted during one `dynctl status` CLI run (target: 1)

    /tmp/venv/bin/python benchmarks/bench_transport.py [--rounds 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from dynctl.agent.client import AgentClient  # noqa: E402
from dynctl.base.config import HostConfig, SSHTarget  # noqa: E402
from dynctl.transport.local import Local  # noqa: E402
from dynctl.transport.pct import Pct  # noqa: E402
from dynctl.transport.ssh import SSH  # noqa: E402
from sshd_harness import FakeHost, start_fake_host  # noqa: E402


def timed(fn: Callable[[], object], rounds: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "min_ms": ordered[0],
        "n": len(ordered),
    }


def measure_connect(fh: FakeHost, rounds: int) -> list[float]:
    samples = []
    for _ in range(rounds):
        t = fh.ssh()
        start = time.perf_counter()
        t.connect()
        samples.append((time.perf_counter() - start) * 1000)
        t.close()
    return samples


def measure_jump_connect(fh: FakeHost, jump: FakeHost, work: Path, rounds: int) -> list[float]:
    cfg = work / "jump_ssh_config"
    cfg.write_text(f"Host target\n  HostName {fh.host}\n  Port {fh.port}\n  User {fh.user}\n"
                   f"  ProxyJump {jump.user}@{jump.host}:{jump.port}\n")
    known = work / "jump_known_hosts"
    known.write_text(f"{fh.host_key_line}\n{jump.host_key_line}\n")
    samples = []
    for _ in range(rounds):
        t = SSH(SSHTarget(None, "target", None), ssh_config_path=str(cfg), known_hosts_path=str(known),
                identity_file=str(fh.client_key))
        start = time.perf_counter()
        t.connect()
        samples.append((time.perf_counter() - start) * 1000)
        t.close()
    return samples


def logins(fh: FakeHost) -> int:
    return fh.server.log.read_text(errors="replace").count("Accepted publickey")


def measure_status_logins(fh: FakeHost, work: Path, ctid: int) -> dict[str, object]:
    """Run the real CLI once per route and count the logins sshd logged meanwhile."""
    out: dict[str, object] = {}
    for route, extra in (("ssh", {}), ("ssh+pct", {"pct": ctid})):
        cfg = fh.write_config(work / f"status-{route}.toml", {"box": {
            "ssh": fh.target, "python": sys.executable, "workdir": str(work / f"status-{route}"), **extra,
        }})
        env = {**os.environ, "HOME": str(work / "home")}
        before = logins(fh)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "dynctl", "status", "--config", str(cfg), "--host", "box",
                               "--json"], capture_output=True, text=True, env=env, timeout=120)
        elapsed = (time.perf_counter() - start) * 1000
        after = _settled_logins(fh, before)
        out[route] = {"logins": after - before, "exit": proc.returncode, "wall_ms": elapsed,
                      "stderr": proc.stderr.strip()[-300:]}
    return out


def _settled_logins(fh: FakeHost, before: int) -> int:
    # sshd writes the log line itself; give it a moment to land after the client exits.
    deadline = time.monotonic() + 1.0
    count = logins(fh)
    while time.monotonic() < deadline and count == before:
        time.sleep(0.02)
        count = logins(fh)
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    opts = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dynctl-bench-transport-"))
    (work / "home").mkdir()
    fh = start_fake_host(work / "sshd")
    jump = start_fake_host(work / "jump", host="127.0.0.2", client_key=fh.client_key)
    try:
        ctid = 129
        fh.make_ct(ctid)
        ssh = fh.ssh()
        pct = Pct(ssh, ctid)
        host = HostConfig(name="bench", python=sys.executable, workdir=str(work / "agent"))
        agents = {
            "local": AgentClient(Local(), host),
            "ssh": AgentClient(ssh, host),
            "ssh+pct": AgentClient(pct, host),
        }
        results: dict[str, object] = {
            "connect": summary(measure_connect(fh, opts.rounds)),
            "connect via ProxyJump": summary(measure_jump_connect(fh, jump, work, opts.rounds)),
            "exec true (ssh)": summary(timed(lambda: ssh.run(["true"]), opts.rounds * 2)),
            "exec true (ssh+pct)": summary(timed(lambda: pct.run(["true"]), opts.rounds * 2)),
        }
        for name, agent in agents.items():
            results[f"agent ping ({name})"] = summary(timed(lambda a=agent: a.call("ping"), opts.rounds))
        results["connections by this process"] = ssh.connections_opened
        results["dynctl status logins"] = measure_status_logins(fh, work, ctid)
    finally:
        jump.stop()
        fh.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"{'measure':<24} {'median ms':>10} {'p90 ms':>8} {'min ms':>8} {'n':>4}")
    for name, row in results.items():
        if isinstance(row, dict) and "median_ms" in row:
            print(f"{name:<24} {row['median_ms']:>10.2f} {row['p90_ms']:>8.2f} {row['min_ms']:>8.2f} {row['n']:>4}")
    print(f"SSH connections for all of the above: {results['connections by this process']}")
    for route, row in results["dynctl status logins"].items():  # type: ignore[union-attr]
        note = "" if row["exit"] == 0 else f"  (exit {row['exit']}: {row['stderr']})"
        print(f"dynctl status via {route}: {row['logins']} SSH login(s), {row['wall_ms']:.0f} ms wall{note}")
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
