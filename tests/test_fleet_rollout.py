"""Rolling deploys through a real smg gateway to three demo hosts over real sshds (one through pct), with a
client streaming through the gateway the whole time: zero failed requests, no stream cut short.

The scenarios share one fleet and run in order: a rollout to 5, a failing one, one killed and resumed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import httpx
import pytest
from demo_box import dynctl
from fleet_harness import SMG, Fleet, dynctl_env
from polling import wait_for

from dynctl.cli.common import open_host

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, sshd, demo_template):
    if not os.path.exists(SMG):
        pytest.fail("smg not found: pip install -e '.[test]' installs the gateway (smg==1.13.0)")
    made = Fleet.build(tmp_path_factory.mktemp("fleet"), sshd, demo_template("0.5.9"))
    try:
        made.start_gateway()
        yield made
    finally:
        made.close()


def thresholds(fleet: Fleet) -> dict[str, object]:
    out = dynctl("status", "--host", "prod", "--json", config=fleet.config)
    assert out.returncode == 0, out.stdout + out.stderr
    return {r["host"]: r["threshold"] for r in json.loads(out.stdout)["hosts"]}


def all_ready(fleet: Fleet) -> bool:
    workers = fleet.workers()
    return all(workers.get(u, {}).get("status", "").lower() == "ready" for u in fleet.worker_urls())


ROLL = ("--yes", "--soak", "0.5", "--drain", "3", "--grace", "20")


def test_rolling_deploy_drops_no_request(fleet):
    with fleet.traffic() as load:
        out = dynctl("deploy", "--threshold", "5", "--host", "prod", *ROLL, config=fleet.config)
        served_before = load.done
        wait_for(lambda: load.done > served_before + 4, 60, "traffic after the rollout")
    assert out.returncode == 0, out.stdout + out.stderr
    assert load.failures == [] and load.cut == [], (load.failures[:5], load.cut[:5])
    assert thresholds(fleet) == {"h1": 5, "h2": 5, "h3": 5}
    assert all_ready(fleet)
    for host in ("h1", "h2", "h3"):
        # the deploy was started and validated on the host while the gateway drained it; its go came after
        prepared = out.stdout.index(f"{host}: deploy of threshold 5 prepared")
        removed = out.stdout.index(f"{host}: removed from {fleet.gateway}")
        assert removed < out.stdout.index(f"{host}: go from") and prepared < out.stdout.index(f"{host}: go from")
    assert "deployed" in out.stdout

    again = dynctl("deploy", "--threshold", "5", "--host", "prod", "--yes", config=fleet.config)
    assert again.returncode == 0 and again.stdout.count("unchanged") == 3, again.stdout


def test_a_failing_host_is_rolled_back_and_the_rollout_stops(fleet):
    bad = fleet.write_config("bad.toml", extra_args={"h2": ["--no-such-flag-for-h2"]})
    with fleet.traffic() as load:
        out = dynctl("deploy", "--threshold", "7", "--host", "prod", *ROLL, config=bad)
    assert out.returncode == 1, out.stdout + out.stderr
    assert load.failures == [] and load.cut == [], (load.failures[:5], load.cut[:5])
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith(("h1 ", "h2 ", "h3 "))}
    assert "deployed" in rows["h1"] and "failed" in rows["h2"] and "untouched" in rows["h3"], out.stdout
    assert thresholds(fleet) == {"h1": 7, "h2": 5, "h3": 5}  # h2 back on its release, h3 never touched
    assert all_ready(fleet)  # h2 is back in the gateway


def test_a_rollout_killed_midway_resumes_and_leaves_no_host_drained(fleet):
    proc = subprocess.Popen([sys.executable, "-m", "dynctl", "deploy", "--threshold", "9", "--host", "prod", *ROLL,
                             "--config", str(fleet.config)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    # kill it while a host is out of the gateway and its deploy runs there (that goes on without the client)
    h1 = open_host("h1", str(fleet.config)).agent
    wait_for(lambda: (len(fleet.workers()) < 3 and h1.call("op_current")["holder"]) or proc.poll() is not None, 60,
             "h1 out of the gateway, its deploy running")
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert proc.returncode == -signal.SIGKILL, proc.stdout.read()
    assert len(fleet.workers()) == 2  # h1 is out
    with fleet.traffic() as load:
        out = dynctl("deploy", "--threshold", "9", "--host", "prod", *ROLL, config=fleet.config)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resuming rollout" in out.stdout
    assert load.failures == [] and load.cut == [], (load.failures[:5], load.cut[:5])
    assert thresholds(fleet) == {"h1": 9, "h2": 9, "h3": 9}
    wait_for(lambda: all_ready(fleet), 30, "every host ready in the gateway")
    ops = dynctl("ops", "list", "--host", "prod", "--json", config=fleet.config)
    assert ops.returncode == 0, ops.stderr
    [record] = json.loads(ops.stdout)  # the killed rollout, resumed and finished: one record
    assert (record["action"], record["target"], record["state"]) == ("deploy", "9", "done")
    assert set(record["hosts"].values()) == {"done"}


def test_gateway_admin_key_comes_from_the_named_variable(fleet):
    fleet.stop_gateway()
    fleet.start_gateway(admin_key="s3cret-admin")
    try:
        keyed = fleet.write_config("keyed.toml", admin_key_env="DYNCTL_TEST_SMG_KEY")
        missing = dynctl_env("deploy", "--threshold", "9", "--host", "prod", "--yes", config=keyed,
                             env={"DYNCTL_TEST_SMG_KEY": ""})
        assert missing.returncode == 2, missing.stdout + missing.stderr
        assert "$DYNCTL_TEST_SMG_KEY" in missing.stderr and "nothing was changed" in missing.stderr
        unkeyed = dynctl("deploy", "--threshold", "9", "--host", "prod", "--yes", config=fleet.config)
        assert unkeyed.returncode == 2 and "refused (401)" in unkeyed.stderr, unkeyed.stdout + unkeyed.stderr
        ok = dynctl_env("status", "--host", "prod", config=keyed, env={"DYNCTL_TEST_SMG_KEY": "s3cret-admin"})
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert ok.stdout.count("ready load") == 3
        assert "s3cret" not in ok.stdout + ok.stderr + missing.stderr + unkeyed.stderr
    finally:
        fleet.stop_gateway()
        fleet.start_gateway()


def test_fan_out_status_with_a_host_unreachable(fleet):
    cfg = fleet.write_config("down.toml")
    text = cfg.read_text().replace('hosts = ["h1", "h2", "h3"]', 'hosts = ["h1", "h2", "h3", "gone"]')
    cfg.write_text(text + '\n[hosts.gone]\nssh = "root@127.0.0.1:1"\n')
    out = dynctl("status", "--host", "prod", "--json", config=cfg)
    assert out.returncode == 4, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    rows = {r["host"]: r for r in doc["hosts"]}
    assert not rows["gone"]["ok"] and rows["gone"]["error"]
    assert all(rows[h]["ok"] and rows[h]["state"] == "ready" for h in ("h1", "h2", "h3"))
    assert all(rows[h]["gateway"][0]["status"] == "ready" for h in ("h1", "h2", "h3"))
    assert rows["gone"]["gateway"][0]["status"] == "not registered"
    table = dynctl("status", "--host", "prod", config=cfg)
    assert table.returncode == 4 and "3 of 4 hosts answered" in table.stdout


def test_without_a_gateway_the_rollout_goes_host_by_host_and_says_there_is_no_drain(fleet):
    cfg = fleet.write_config("plain.toml")
    cfg.write_text(cfg.read_text().replace(f'gateway = "{fleet.gateway}"\n', ""))
    refused = dynctl("deploy", "--threshold", "11", "--host", "prod", "--canary", "1", "--soak", "0", config=cfg)
    assert refused.returncode == 2 and "refusing without --yes" in refused.stderr  # no TTY: --yes or nothing
    out = dynctl("deploy", "--threshold", "11", "--host", "prod", "--canary", "1", *ROLL, config=cfg)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "canary hosts done (h1): going on with h2, h3" in out.stdout
    for host in ("h1", "h2", "h3"):
        assert f"{host}: no gateway in front of it: no drain" in out.stdout + out.stderr
    assert "removed from" not in out.stdout
    assert thresholds(fleet) == {"h1": 11, "h2": 11, "h3": 11}


def test_max_unavailable_two_drains_two_hosts_at_once_and_the_third_after_them(fleet):
    names = {u: h for h, u in zip(("h1", "h2", "h3"), fleet.worker_urls())}
    seen: list[frozenset[str]] = []  # the hosts out of selection (not listed, or not ready), sample by sample
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                workers = fleet.workers()
                seen.append(frozenset(h for u, h in names.items()
                                      if workers.get(u, {}).get("status", "").lower() != "ready"))
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    with fleet.traffic() as load:
        watcher.start()
        try:
            out = dynctl("deploy", "--threshold", "13", "--host", "prod", "--max-unavailable", "2", *ROLL,
                         config=fleet.config)
        finally:
            stop.set()
            watcher.join(10)
    assert out.returncode == 0, out.stdout + out.stderr
    assert load.failures == [] and load.cut == [], (load.failures[:5], load.cut[:5])
    assert thresholds(fleet) == {"h1": 13, "h2": 13, "h3": 13}
    assert frozenset({"h1", "h2"}) in seen, sorted(set(seen), key=len)  # the first two out of the gateway together
    assert max(len(s) for s in seen) == 2  # never all three: one host served all along
    assert all(s == {"h3"} for s in seen if "h3" in s)  # h3 only once both were back and ready
    assert frozenset({"h3"}) in seen
    assert "2 at a time" in out.stdout


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


class OnPty:
    """The CLI on a real pseudo-terminal: stdin, stdout and stderr all a TTY, as an operator runs it."""

    def __init__(self, *args: str, config):
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.proc = subprocess.Popen([sys.executable, "-m", "dynctl", *args, "--config", str(config)], stdin=slave,
                                     stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.fd, self.raw = master, b""

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", "replace"))

    def _read(self, wait: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], wait)
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # EIO: every holder of the slave side has closed it
            return False
        self.raw += chunk
        return bool(chunk)

    def expect(self, text: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.text:
            if time.monotonic() > deadline or not self._read(0.2) and text not in self.text:
                raise AssertionError(f"{text!r} never appeared; the terminal shows:\n{self.text[-3000:]}")

    def answer(self, word: str) -> None:
        os.write(self.fd, word.encode() + b"\n")

    def finish(self, timeout: float = 180) -> int:
        deadline = time.monotonic() + timeout
        while self._read(0.2) and time.monotonic() < deadline:
            pass
        os.close(self.fd)
        return self.proc.wait(max(1.0, deadline - time.monotonic()))


CANARY_PROMPT = "Canary hosts done (h1); continue with h2, h3?"


def test_canary_pause_on_a_tty_no_stops_the_rollout_leaving_the_rest_untouched(fleet):
    before = thresholds(fleet)
    term = OnPty("deploy", "--threshold", "15", "--host", "prod", "--canary", "1", "--soak", "0.5", "--drain", "3",
                 "--grace", "20", config=fleet.config)
    try:
        term.expect("through " + fleet.gateway)  # the rollout's own confirmation first
        term.answer("y")
        term.expect(CANARY_PROMPT)
        # the prompt comes once the canary host is deployed and back in the gateway, before anything else moves
        assert thresholds(fleet) == {"h1": 15, "h2": before["h2"], "h3": before["h3"]}
        assert all_ready(fleet)
        term.answer("n")
    finally:
        code = term.finish()
    assert code == 1, term.text  # not 3: the canary host did change
    assert "stopped at the canary pause: h2, h3 untouched" in term.text
    rows = {line.split()[0]: line for line in term.text.splitlines() if line.startswith(("h1 ", "h2 ", "h3 "))}
    assert "deployed" in rows["h1"] and "untouched" in rows["h2"] and "untouched" in rows["h3"], term.text
    assert thresholds(fleet) == {"h1": 15, "h2": before["h2"], "h3": before["h3"]}
    assert all_ready(fleet)
    ops = dynctl("ops", "list", "--host", "prod", "--json", config=fleet.config)
    newest = json.loads(ops.stdout)[0]
    assert (newest["target"], newest["state"]) == ("15", "stopped")
    assert newest["hosts"] == {"h1": "done", "h2": "pending", "h3": "pending"}


def test_canary_pause_on_a_tty_yes_goes_on_with_the_rest(fleet):
    term = OnPty("deploy", "--threshold", "17", "--host", "prod", "--canary", "1", "--soak", "0.5", "--drain", "3",
                 "--grace", "20", config=fleet.config)
    try:
        term.expect("through " + fleet.gateway)
        term.answer("y")
        term.expect(CANARY_PROMPT)
        assert thresholds(fleet)["h1"] == 17 and {thresholds(fleet)[h] for h in ("h2", "h3")} != {17}
        term.answer("y")
        term.expect("canary hosts done (h1): going on with h2, h3")
    finally:
        code = term.finish()
    assert code == 0, term.text
    assert thresholds(fleet) == {"h1": 17, "h2": 17, "h3": 17}
    wait_for(lambda: all_ready(fleet), 30, "every host ready in the gateway")
