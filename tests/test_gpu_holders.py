"""The live view's per-GPU process list, end to end: the agent asks the demo host's nvidia-smi which processes
hold each GPU and names their owner and command from /proc; the snapshot puts them on their GPU."""

from __future__ import annotations

import getpass

import pytest

from demo_box import dynctl, server_pid, session
from dynctl.live.snapshot import build_snapshot

pytestmark = pytest.mark.slow


def test_the_simulated_servers_processes_are_listed_on_their_gpus(demo_box):
    config = demo_box(via="local")
    res = dynctl("start", "--yes", config=config)
    assert res.returncode == 0, res.stdout + res.stderr
    pid = server_pid(config)
    agent = session(config).agent
    snap = None
    for item in agent.stream("watch", interval=0.3, max_items=4, log_lines=0, gpu_procs=True):
        snap = build_snapshot(item, "box", snap)
        if snap.gpus and snap.gpu_processes:
            break
    assert snap is not None and snap.gpu_processes, "no GPU processes listed"
    on_gpus = {h.gpu for h in snap.gpu_processes}
    assert on_gpus <= {g.index for g in snap.gpus} and None not in on_gpus
    ours = [h for h in snap.gpu_processes if h.user == getpass.getuser() and h.used_mib]
    assert ours and all(h.command for h in ours)
    assert any(h.pid == pid or "dynctl.sim" in (h.command or "") or "sglang" in (h.command or "") for h in ours)
