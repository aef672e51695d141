"""Rolling deploys through a real smg gateway to three demo hosts over real sshds (one through pct), with a
client streaming through the gateway the whole time: zero failed requests, no stream cut short.

The scenarios share one fleet and run in order: a rollout to 5, a failing one, one killed and resumed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from demo_box import dynctl
from fleet_harness import SMG, Fleet, dynctl_env
from polling import wait_for

from dynctl.cli.common import open_host

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, sshd, demo_template):
    import os

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
        assert f"{host}: removed from {fleet.gateway}" in out.stdout
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
