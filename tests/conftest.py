"""Shared fixtures: an isolated $HOME for every test, and real OpenSSH servers on loopback.

`sshd` (session) is a FakeHost: `.host .port .user .target .client_key .host_key_line .tmp`,
`.make_ct(ctid, state="running")`, `.ssh(**kw)` (a dynctl SSH transport), and
`.write_config(path, {"box": {"ssh": sshd.target, "pct": 129, ...}})` for end-to-end tests.
`sshd_factory` (function) starts more servers that the test may kill (ProxyJump down, reconnects).
`demo_box` (function) makes private demo hosts: the simulated sglang server on a real sglang tree.
`site_059`, `patched_site_059` (session) are sglang trees and `start_sim` (function) starts the simulator on one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sshd_harness import SSHD, FakeHost, start_fake_host


def pytest_configure(config: pytest.Config) -> None:
    """A runner started in the background (`&` without job control, nohup) has SIGINT ignored, and an ignored
    signal stays ignored in every process it starts: the tests that press Ctrl-C on a dynctl need it heard."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def isolated_home(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory):
    """~/.ssh/config, ~/.ssh/known_hosts and ~/.config/dynctl are empty temp dirs; no ssh-agent."""
    home = tmp_path_factory.mktemp("home")
    (home / ".ssh").mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    for var in ("XDG_CONFIG_HOME", "DYNCTL_CONFIG", "SSH_AUTH_SOCK", "SSH_AGENT_PID"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHost]:
    if not os.path.exists(SSHD):
        pytest.fail("sshd not found: apt-get install -y openssh-server (the SSH tests need a real one)")
    host = start_fake_host(tmp_path_factory.mktemp("fakehost"), marker=f"dyntest-{uuid.uuid4().hex}")
    try:
        yield host
    finally:
        host.stop()


@pytest.fixture
def sshd_factory(tmp_path_factory: pytest.TempPathFactory, sshd: FakeHost) -> Iterator[Callable[..., FakeHost]]:
    """Start extra sshds (same client key as `sshd` unless share_key=False); all stopped after the test."""
    started: list[FakeHost] = []

    def start(host: str = "127.0.0.1", *, share_key: bool = True, max_sessions: int = 10,
              extra_config: Callable[[Path], str] | None = None) -> FakeHost:
        fh = start_fake_host(tmp_path_factory.mktemp("extra-sshd"), host=host, max_sessions=max_sessions,
                             client_key=sshd.client_key if share_key else None, extra_config=extra_config)
        started.append(fh)
        return fh

    yield start
    for fh in reversed(started):
        fh.stop()


@pytest.fixture(scope="session")
def demo_template(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A prepared demo host per sglang version, for tests to copy (the wheel is installed once per session)."""
    from dynctl.sim.hostsetup import prepare_demo_host
    from sglang_trees import sglang_wheel

    made: dict[str, Path] = {}

    def get(version: str = "0.5.9") -> Path:
        if version not in made:
            root = tmp_path_factory.mktemp(f"demo-template-{version}")
            prepare_demo_host(root / "demo", sglang_version=version, cache_dir=sglang_wheel(version).parent)
            made[version] = root / "demo"
        return made[version]

    return get


@pytest.fixture
def demo_box(request: pytest.FixtureRequest, demo_template, tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """make(version="0.5.9", *, via="pct", time_scale=20, strategy=None, **env) -> config path of a private demo
    host `box` (strategy: the host's `strategy` key, unset when None).

    via "pct": inside container 129 on the test sshd, reached as a Proxmox box is; "ssh": on the test sshd;
    "local": on this machine without SSH. Whatever server it started is stopped afterwards (by dynctl,
    then by its environment marker).
    """
    from demo_box import dynctl, kill_servers_of, make_demo_box

    from dynctl.base.config import load_config
    from dynctl.transport import close_all

    made: list[Path] = []

    def make(version: str = "0.5.9", *, via: str = "pct", time_scale: float = 20, strategy: str | None = None,
             **env: str) -> Path:
        if via not in ("pct", "ssh", "local"):
            raise ValueError(f"via={via!r}: expected pct, ssh or local")
        sshd = None if via == "local" else request.getfixturevalue("sshd")
        made.append(make_demo_box(sshd, demo_template(version), tmp_path, version, pct=via == "pct",
                                  time_scale=time_scale, strategy=strategy, **env))
        return made[-1]

    yield make
    close_all()
    for config in made:
        dynctl("stop", "--yes", "--grace", "5", config=config)
        kill_servers_of(Path(load_config(config).host(None).workdir))


@pytest.fixture
def local_demo(demo_box):
    """A demo host on this machine (no SSH), its server not started: a HostSession."""
    from demo_box import session

    return session(demo_box(via="local"))


# ---- the simulated sglang server on its own (tests/sim_harness.py), without a demo host around it


@pytest.fixture(scope="session")
def site_059(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pristine sglang 0.5.9 tree (shared: tests must not modify it)."""
    site = tmp_path_factory.mktemp("sglang-0.5.9") / "site"
    from sglang_trees import install_sglang

    install_sglang("0.5.9", site)
    return site


@pytest.fixture(scope="session")
def patched_site_059(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sglang 0.5.9 with dynctl's patch applied (shared: tests must not modify it)."""
    site = tmp_path_factory.mktemp("sglang-0.5.9-patched") / "site"
    from sim_harness import install_patched

    install_patched("0.5.9", site)
    return site


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """start_sim(site, argv, env=None) -> Sim (not yet ready); every server is killed after the test."""
    from sim_harness import Sim

    started: list[Sim] = []

    def start(site: Path, argv: list[str], env: dict[str, str] | None = None, port: int | None = None) -> Sim:
        sim = Sim(site, argv, tmp_path, env, port)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.stop()


@pytest.fixture
def owned() -> Iterator[list[subprocess.Popen]]:
    """Processes a scenario starts itself (decoys, stand-ins, foreign listeners): killed by pid afterwards."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
