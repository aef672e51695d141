"""Three demo hosts behind three loopback sshds (the first through `pct`), one real `smg` gateway in front of
them, and a client streaming through the gateway: the world of tests/test_fleet_*.py.

    fleet = Fleet.build(tmp, sshd, demo_template)       # hosts h1 h2 h3, group `prod`, servers started
    fleet.start_gateway(admin_key=None)                  # smg on a free loopback port, the three registered
    with fleet.traffic() as load: ...                    # /generate and /v1/completions streams all along
    load.failures, load.cut, load.done
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path
from typing import Any

import httpx
from demo_box import dynctl, kill_servers_of, make_demo_box
from polling import wait_for
from sshd_harness import FakeHost, free_port, start_fake_host, toml_value

SMG = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
MAX_TOKENS = 1500  # about half a second a request at the demo's time scale: a restart without a drain cuts it


class Traffic:
    """Closed-loop streams through the gateway; every request must end complete."""

    def __init__(self, gateway: str, streams: int = 4):
        self.gateway = gateway
        self.streams = streams
        self.stop = threading.Event()
        self.done = 0
        self.failures: list[str] = []
        self.cut: list[str] = []
        self.served_by: dict[str, int] = {}
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(streams)]

    def _loop(self, i: int) -> None:
        with httpx.Client(base_url=self.gateway, timeout=60) as http:
            n = 0
            while not self.stop.is_set():
                n += 1
                try:
                    self._completion(http, f"s{i} r{n}") if n % 2 else self._generate(http, f"s{i} r{n}")
                except Exception as err:  # noqa: BLE001 - any failure of a request is what the test counts
                    with self.lock:
                        self.failures.append(f"{type(err).__name__}: {err}")

    def _note(self, response: httpx.Response) -> None:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:200]!r}")
        worker = response.headers.get("x-smg-routed-worker-id", "?")
        with self.lock:
            self.served_by[worker] = self.served_by.get(worker, 0) + 1

    def _completion(self, http: httpx.Client, tag: str) -> None:
        body = {"model": "/models/demo-simulated", "prompt": f"fleet {tag}", "max_tokens": MAX_TOKENS,
                "stream": True, "ignore_eos": True}
        finish, saw_done = None, False
        with http.stream("POST", "/v1/completions", json=body) as response:
            self._note(response)
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    saw_done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    finish = (chunk.get("choices") or [{}])[0].get("finish_reason") or finish
        self._end(tag, finish == "length" and saw_done, f"completion finish={finish} done={saw_done}")

    def _generate(self, http: httpx.Client, tag: str) -> None:
        body = {"text": f"fleet {tag}", "stream": True,
                "sampling_params": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True}}
        last: dict[str, Any] = {}
        with http.stream("POST", "/generate", json=body) as response:
            self._note(response)
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
        meta = last.get("meta_info") or {}
        self._end(tag, meta.get("completion_tokens") == MAX_TOKENS, f"generate ended at {meta}")

    def _end(self, tag: str, complete: bool, detail: str) -> None:
        with self.lock:
            if complete:
                self.done += 1
            else:
                self.cut.append(f"{tag}: {detail}")

    def __enter__(self) -> "Traffic":
        for t in self.threads:
            t.start()
        wait_for(lambda: self.done >= self.streams or self.failures, 60, "traffic through the gateway")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


class Fleet:
    def __init__(self, tmp: Path, sshds: list[FakeHost], entries: dict[str, dict[str, Any]]):
        self.tmp, self.sshds, self.entries = tmp, sshds, entries
        self.gateway_port = free_port()
        self.gateway = f"http://127.0.0.1:{self.gateway_port}"
        self.smg: subprocess.Popen | None = None
        self.config = self.write_config()

    @classmethod
    def build(cls, tmp: Path, sshd: FakeHost, template: Path, count: int = 3) -> "Fleet":
        sshds = [sshd] + [start_fake_host(tmp / f"sshd-{i}", client_key=sshd.client_key) for i in range(2, count + 1)]
        entries: dict[str, dict[str, Any]] = {}
        for i, box_sshd in enumerate(sshds, start=1):
            where = tmp / f"h{i}"
            where.mkdir()
            config = make_demo_box(box_sshd, template, where, pct=i == 1, ctid=130, time_scale=20)
            entry = tomllib.loads(config.read_text())["hosts"]["box"]
            entries[f"h{i}"] = entry
        fleet = cls(tmp, sshds, entries)
        try:
            for name in entries:
                out = dynctl("start", "--yes", "--host", name, config=fleet.config)
                assert out.returncode == 0, out.stdout + out.stderr
        except BaseException:
            fleet.close()
            raise
        return fleet

    def write_config(self, name: str = "dynctl.toml", *, admin_key_env: str | None = None,
                     extra_args: dict[str, list[str]] | None = None) -> Path:
        known = self.tmp / "known_hosts"
        known.write_text("".join(s.host_key_line + "\n" for s in self.sshds))
        known.chmod(0o600)
        lines = [f"known_hosts = {toml_value(str(known))}", f"ssh_config = {toml_value(str(self.tmp / 'none'))}"]
        for host, entry in self.entries.items():
            values = dict(entry)
            values["args"] = list(values.get("args", [])) + (extra_args or {}).get(host, [])
            lines.append(f"\n[hosts.{host}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        lines += ["\n[groups.prod]", f"hosts = {toml_value(list(self.entries))}", f"gateway = {toml_value(self.gateway)}"]
        if admin_key_env:
            lines.append(f"admin_key_env = {toml_value(admin_key_env)}")
        path = self.tmp / name
        (self.tmp / "none").touch()
        path.write_text("\n".join(lines) + "\n")
        return path

    def worker_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{e['port']}" for e in self.entries.values()]

    def start_gateway(self, admin_key: str | None = None) -> None:
        argv = [SMG, "launch", "--host", "127.0.0.1", "--port", str(self.gateway_port), "--policy", "round_robin",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--worker-urls", *self.worker_urls()]
        if admin_key:
            argv += ["--control-plane-api-keys", f"k1:dynctl:admin:{admin_key}"]
        log = open(self.tmp / "smg.log", "ab")
        self.smg = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        wait_for(lambda: self.ready_workers(headers) == len(self.entries), 60, "smg with every worker ready")

    def ready_workers(self, headers: dict[str, str] | None = None) -> int:
        if self.smg is not None and self.smg.poll() is not None:
            raise AssertionError(f"smg exited {self.smg.returncode}: {(self.tmp / 'smg.log').read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            workers = httpx.get(f"{self.gateway}/workers", headers=headers or {}, timeout=5).json()["workers"]
            return sum(w["status"].lower() == "ready" for w in workers)
        return 0

    def workers(self, headers: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
        workers = httpx.get(f"{self.gateway}/workers", headers=headers or {}, timeout=5).json()["workers"]
        return {w["url"]: w for w in workers}

    def stop_gateway(self) -> None:
        if self.smg is not None and self.smg.poll() is None:
            self.smg.terminate()
            try:
                self.smg.wait(20)
            except subprocess.TimeoutExpired:
                self.smg.kill()
                self.smg.wait(10)
        self.smg = None

    def traffic(self, streams: int = 4) -> Traffic:
        return Traffic(self.gateway, streams)

    def close(self) -> None:
        self.stop_gateway()
        for host, entry in self.entries.items():
            dynctl("stop", "--yes", "--grace", "5", "--host", host, config=self.config)
            kill_servers_of(Path(entry["workdir"]))
        for sshd in self.sshds[1:]:
            sshd.stop()


def dynctl_env(*args: str, config: Path, env: dict[str, str] | None = None, timeout: float = 300
               ) -> subprocess.CompletedProcess:
    """The CLI in a process of its own with extra environment variables."""
    return subprocess.run([sys.executable, "-m", "dynctl", *args, "--config", str(config)], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=timeout, env={**os.environ, **(env or {})})
