"""A fleet of demo hosts over one loopback sshd: fan-out status of 8 and 32 hosts, and a rolling deploy of 8
hosts behind a real smg gateway with clients streaming through it.

Reported:
  status         wall time of `status --host GROUP` (connections included) against the slowest single host's
                 `status` alone (target <= 1.5x), and what bounds it on this box: the CPU of every host's side
                 (sshd session, agent, verb, nvidia-smi; the sshd's reaped children) and of the client, over the
                 cores (`cpu_floor`; `floor_ratio` above 1.5 means the box alone misses the target)
  rollout        total wall time; per host its own drain (the gateway's settle time) + stop + start→ready, and
                 dynctl's overhead per host = the host's time in the rollout - that (target <= 1 s)
  requests       streamed through the gateway during the rollout: completed, failed, cut short (target 0)

    .venv/bin/python benchmarks/fleet_rollout.py [--hosts 8] [--status-hosts 32] [--time-scale 20] [--drain 2]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from dynctl.base import events  # noqa: E402
from dynctl.agent.client import AgentClient  # noqa: E402
from dynctl.base.config import load_config  # noqa: E402
from dynctl.core.fleet import fan_out, fleet_status, fleet_target  # noqa: E402
from dynctl.core.lifecycle import restart_server, server_argv  # noqa: E402
from dynctl.core.rollout import RollingOperation  # noqa: E402
from dynctl.live.server_status import sample_server  # noqa: E402
from dynctl.sim.hostsetup import install_nvidia_smi, prepare_demo_host  # noqa: E402
from dynctl.transport import close_all, connect  # noqa: E402
from fleet_harness import SMG, Traffic  # noqa: E402
from sglang_trees import sglang_wheel  # noqa: E402
from sshd_harness import free_port, start_fake_host, toml_value  # noqa: E402


class HostSteps:
    """StepDone events of the rollout, summed per host (the rollout prefixes each detail with its host), and
    every event but the servers' log lines on one clock (the report's `timeline`)."""

    def __init__(self) -> None:
        self.steps: dict[str, dict[str, float]] = {}
        self.t0 = time.perf_counter()
        self.timeline: list[str] = []

    def __call__(self, event: object) -> None:
        if not isinstance(event, events.LogLine):  # the servers' logs are theirs, not the rollout's steps
            text = getattr(event, "detail", None) or getattr(event, "text", "")
            self.timeline.append(f"{time.perf_counter() - self.t0:8.3f} {type(event).__name__} "
                                 f"{getattr(event, 'step', '')} {text[:100]}")
        if isinstance(event, events.StepDone) and ": " in event.detail:
            host = event.detail.split(": ", 1)[0]
            per = self.steps.setdefault(host, {})
            per[event.step] = per.get(event.step, 0.0) + event.elapsed


def make_hosts(tmp: Path, fh, count: int, own_sites: int, time_scale: float) -> dict[str, dict]:
    """`count` demo hosts on the sshd; the first `own_sites` with a tree of their own (they get deployed to),
    the rest sharing the first tree (they are only sampled)."""
    entries: dict[str, dict] = {}
    first = None
    for i in range(1, count + 1):
        root = tmp / f"h{i:02d}"
        if i <= own_sites:
            if first is not None:
                shutil.copytree(first / "site", root / "site", symlinks=True)
            entry = prepare_demo_host(root, port=free_port(), cache_dir=sglang_wheel("0.5.9").parent,
                                      time_scale=time_scale)
            first = first or root
        else:
            entry = json.loads(json.dumps(entries["h01"]))
            for sub in ("work", "gpu", "bin"):
                (root / sub).mkdir(parents=True, mode=0o700)
            shutil.copy(first / "gpu" / "gpus.json", root / "gpu" / "gpus.json")
            install_nvidia_smi(root / "bin" / "nvidia-smi", root / "gpu")
            entry.update(workdir=str(root / "work"), port=free_port())
            entry["env"].update(PATH=f"{root / 'bin'}:${{PATH}}", DYNCTL_SIM_GPU_DIR=str(root / "gpu"))
        entry.update(ssh=fh.target)
        entries[f"h{i:02d}"] = entry
    return entries


def write_config(fh, path: Path, entries: dict[str, dict], groups: dict[str, list[str]], gateway: str) -> Path:
    fh.write_config(path, entries)
    lines = [path.read_text()]
    for name, members in groups.items():
        lines += [f"\n[groups.{name}]", f"hosts = {toml_value(members)}"]
        if name == "roll":
            lines.append(f"gateway = {toml_value(gateway)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _cpu_ticks(pid: int) -> int:
    """utime + stime + cutime + cstime of `pid` (its own CPU and that of every descendant it has reaped)."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in rest[11:15])


class HostSideCPU:
    """The CPU the hosts' side of a call took on this box: every SSH session, agent, verb and nvidia-smi runs
    under the one sshd. A session is reaped by the sshd once its connection closes (its CPU is the sshd's
    cumulative children time); an agent or nvidia-smi that outlives its session (a watch ends at its next
    write) is orphaned, and this process, a child subreaper while it measures, reaps it (its CPU is ours
    of children). Both are read once every connection and orphan is gone."""

    PR_SET_CHILD_SUBREAPER = 36

    def __init__(self, sshd_pid: int) -> None:
        self.sshd = psutil.Process(sshd_pid)
        self.tick = os.sysconf("SC_CLK_TCK")
        self.keep = {c.pid for c in psutil.Process().children()}  # the sshd and anything else of ours
        self.libc = ctypes.CDLL(None, use_errno=True)
        if self.libc.prctl(self.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise SystemExit(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")

    def close(self) -> None:
        self.libc.prctl(self.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)

    def settled(self) -> float:
        close_all()
        deadline = time.monotonic() + 30
        while True:
            orphans = [c.pid for c in psutil.Process().children() if c.pid not in self.keep]
            for pid in orphans:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            if not orphans and not self.sshd.children():
                break
            if time.monotonic() > deadline:
                raise SystemExit("the sshd's sessions or their orphans did not exit in 30 s")
            time.sleep(0.02)
        own = resource.getrusage(resource.RUSAGE_CHILDREN)
        return _cpu_ticks(self.sshd.pid) / self.tick + own.ru_utime + own.ru_stime

    def seconds(self, before: float) -> float:
        return self.settled() - before


def timed_status(config, group: str, cpu: HostSideCPU, runs: int = 3) -> dict[str, float]:
    """Median wall time, hosts' CPU and client CPU of `status --host group` (connections included)."""
    walls, hosts, client = [], [], []
    for _ in range(runs):
        before = cpu.settled()
        fleet = fleet_target(config, group, None)
        c0, t0 = time.process_time(), time.perf_counter()
        rows, _ = fleet_status(fleet, config)
        walls.append(time.perf_counter() - t0)
        client.append(time.process_time() - c0)
        hosts.append(cpu.seconds(before))
        bad = [r.host for r in rows if not r.ok]
        assert not bad, f"no answer from {bad}"
    return {"wall_s": statistics.median(walls), "hosts_cpu_s": statistics.median(hosts),
            "client_cpu_s": statistics.median(client)}


def single_status(config, name: str, cpu: HostSideCPU) -> tuple[float, float]:
    """Wall time and hosts' CPU of one host's status alone."""
    before = cpu.settled()
    host = config.hosts[name]
    t0 = time.perf_counter()
    sample_server(AgentClient(connect(host, config), host), host.simulated)
    wall = time.perf_counter() - t0
    return wall, cpu.seconds(before)


def status_report(report: dict, n: int, measured: dict[str, float], slowest: float) -> None:
    """The raw ratio against the slowest single host, and the box's CPU floor: all hosts' side and the client's
    CPU spread over this box's cores, the least wall time any client could take here."""
    cores = os.cpu_count() or 1
    floor = (measured["hosts_cpu_s"] + measured["client_cpu_s"]) / cores
    report[f"status_{n}_s"] = measured["wall_s"]
    report[f"status_{n}_ratio"] = measured["wall_s"] / slowest
    report[f"status_{n}_hosts_cpu_s"] = measured["hosts_cpu_s"]
    report[f"status_{n}_client_cpu_s"] = measured["client_cpu_s"]
    report[f"status_{n}_cpu_floor_s"] = floor
    report[f"status_{n}_floor_ratio"] = floor / slowest  # above 1.5: the box alone misses the target
    report[f"status_{n}_target_s"] = 1.5 * slowest
    report[f"status_{n}_met"] = measured["wall_s"] <= 1.5 * slowest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--status-hosts", type=int, default=32)
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--drain", type=float, default=2.0)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--json")
    ap.add_argument("--status-only", action="store_true", help="measure status alone, no rollout")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    fh = start_fake_host(tmp / "sshd", marker=f"bench-fleet-{time.time_ns()}", max_sessions=64)
    smg = None
    report: dict = {}
    entries: dict[str, dict] = {}
    try:
        n_status = max(args.status_hosts, args.hosts)
        entries = make_hosts(tmp, fh, n_status, args.hosts, args.time_scale)
        names = list(entries)
        gateway = f"http://127.0.0.1:{free_port()}"
        groups = {"roll": names[:args.hosts], "eight": names[:8], "all": names}
        config = load_config(write_config(fh, tmp / "dynctl.toml", entries, groups, gateway))
        fan_out(names, lambda n: restart_server(AgentClient(connect(config.hosts[n], config), config.hosts[n]),
                                                server_argv(config.hosts[n])), 4)
        cpu = HostSideCPU(fh.server.proc.pid)
        singles = [single_status(config, n, cpu) for n in names[:8]]
        slowest = max(w for w, _ in singles)
        report["status_single_slowest_s"] = slowest
        report["status_single_median_s"] = statistics.median(w for w, _ in singles)
        report["status_single_hosts_cpu_s"] = statistics.median(c for _, c in singles)
        report["cores"] = os.cpu_count()
        report["load_average_at_status"] = os.getloadavg()
        status_report(report, 8, timed_status(config, "eight", cpu), slowest)
        status_report(report, n_status, timed_status(config, "all", cpu), slowest)
        cpu.close()
        if args.status_only:
            return _print(report, args)
        # the rollout's hosts only, from here on
        close_all()
        fan_out(names[args.hosts:], lambda n: AgentClient(connect(config.hosts[n], config), config.hosts[n]).call(
            "server_stop", grace=10), 4)
        urls = [config.hosts[n].gateway_url for n in names[:args.hosts]]
        smg = subprocess.Popen([SMG, "launch", "--host", "127.0.0.1", "--port", gateway.rsplit(":", 1)[1],
                                "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port",
                                str(free_port()), "--worker-urls", *urls], stdin=subprocess.DEVNULL,
                               stdout=open(tmp / "smg.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                ws = httpx.get(f"{gateway}/workers", timeout=5).json()["workers"]
                if sum(w["status"].lower() == "ready" for w in ws) == len(urls):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit("smg did not list every worker ready in 60 s")
            time.sleep(0.2)
        close_all()
        fleet = fleet_target(config, "roll", None)
        clock = HostSteps()
        op = RollingOperation(config, fleet, "deploy", 5, on_event=clock, soak=0, drain=args.drain, grace=20)
        report["load_average_at_rollout"] = os.getloadavg()
        with Traffic(gateway, args.streams) as load:
            t0 = time.perf_counter()
            record, results = op.run(lambda q: True)
            total = time.perf_counter() - t0
        op.close()
        rows = []
        for r in results:
            steps = clock.steps.get(r.host, {})
            own = r.drain_s + steps.get("stop", 0) + steps.get("start", 0) + steps.get("ready", 0)
            rows.append({"host": r.host, "outcome": r.outcome, "elapsed_s": r.elapsed_s, "drain_s": r.drain_s,
                         "stop_s": steps.get("stop", 0), "start_ready_s": steps.get("start", 0) + steps.get("ready", 0),
                         "own_s": own, "overhead_s": r.elapsed_s - own,
                         "host_op_own_s": r.operation_s - steps.get("stop", 0) - steps.get("start", 0)
                         - steps.get("ready", 0), "register_s": r.register_s})
        report.update(rollout_total_s=total, rollout_sum_own_s=sum(r["own_s"] for r in rows),
                      rollout_overhead_per_host_median_s=statistics.median(r["overhead_s"] for r in rows),
                      rollout_overhead_per_host_max_s=max(r["overhead_s"] for r in rows),
                      rollout_state=record.state, requests_completed=load.done, requests_failed=len(load.failures),
                      requests_cut=len(load.cut), hosts=rows, timeline=clock.timeline, steps=clock.steps)
    finally:
        if smg is not None:
            smg.terminate()
            smg.wait(20)
        close_all()
        for name, entry in entries.items():
            try:
                host = load_config(tmp / "dynctl.toml").hosts[name]
                AgentClient(connect(host, load_config(tmp / "dynctl.toml")), host).call("server_stop", grace=10)
            except Exception:  # noqa: BLE001 - best effort: every server is ours, stopped through its own record
                pass
        close_all()
        fh.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    _print(report, args)


def _print(report: dict, args: argparse.Namespace) -> None:
    for r in report.get("hosts", []):
        print(f"{r['host']:<5}{r['outcome']:<10} total {r['elapsed_s']:6.2f}  drain {r['drain_s']:5.2f}  stop "
              f"{r['stop_s']:5.2f}  start→ready {r['start_ready_s']:5.2f}  overhead {r['overhead_s']:5.2f} s (host "
              f"operation's own {r['host_op_own_s']:4.2f}, re-register+ready+probe {r['register_s']:4.2f})")
    print(json.dumps({k: v for k, v in report.items() if k not in ("hosts", "timeline", "steps")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
