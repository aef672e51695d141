"""How the agent recognises the server by command line: sglang's launcher on our port, never a decoy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dynctl_agent import servers as agent


def ctx(port=30000, launch=("python3", "-m", "sglang.launch_server")):
    return SimpleNamespace(port=port, launch=list(launch))


@pytest.mark.parametrize("cmd, expected", [
    (["/opt/v/bin/python3", "-m", "sglang.launch_server", "--model-path", "m", "--port", "30000"], True),
    (["python3", "-u", "-X", "dev", "-m", "sglang.launch_server", "--port=30000"], True),
    (["python3", "-msglang.launch_server"], True),  # no --port: sglang's default 30000
    (["python3", "-m", "sglang.launch_server", "--port", "30001"], False),  # a second server
    (["python3", "-c", "import time", "-m", "sglang.launch_server", "--port", "30000"], False),  # decoy
    (["python3", "-c", "import time", "python3 -m sglang.launch_server --port 30000"], False),
    (["python3", "script.py", "-m", "sglang.launch_server"], False),
    (["sglang::scheduler_TP0"], False),
    ([], False),
])
def test_sglang_launcher_on_our_port(cmd, expected):
    assert agent.looks_like_server(ctx(), cmd) is expected


def test_configured_launch_is_recognised():
    demo = ctx(port=31000, launch=("/usr/bin/python3", "-m", "dynctl.sim"))
    assert agent.looks_like_server(demo, ["/usr/bin/python3", "-m", "dynctl.sim", "--port", "31000"])
    assert not agent.looks_like_server(demo, ["/usr/bin/python3", "-m", "dynctl.sim", "--port", "31001"])
    script = ctx(port=31000, launch=("/opt/serve.sh",))
    assert agent.looks_like_server(script, ["/bin/bash", "/opt/serve.sh", "--port", "31000"])


def test_recorded_argv_survives_a_shebang_but_not_another_program():
    argv = ["/opt/v/bin/sglang-serve", "--port", "30000"]
    assert agent.argv_matches(argv, argv)
    assert agent.argv_matches(["/opt/v/bin/python3", "/opt/v/bin/sglang-serve", "--port", "30000"], argv)
    assert not agent.argv_matches(["/usr/bin/sleep", "--port", "30000"], argv)
    assert not agent.argv_matches(["/opt/v/bin/sglang-serve", "--port", "30001"], argv)
