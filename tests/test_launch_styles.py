"""Launch styles the agent recognises: `sglang serve` by the configured environment's console script (strictly:
`vllm serve` or `ollama serve` on the port are not sglang), and the port a `--config file.yaml` sets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dynctl.base import sglang
from dynctl_agent import launchconfig
from dynctl_agent import servers as agent

ENV = "/opt/sg/bin"


def ctx(port=30000, launch=(), python=f"{ENV}/python3"):
    return SimpleNamespace(port=port, launch=list(launch), python=python)


@pytest.mark.parametrize("cmd, expected", [
    ([f"{ENV}/python3", f"{ENV}/sglang", "serve", "--model-path", "m"], True),  # the script behind its shebang
    ([f"{ENV}/sglang", "serve", "--model-path", "m", "--port", "30000"], True),
    ([f"{ENV}/python3", f"{ENV}/sglang", "serve", "--port", "30001"], False),  # another port
    ([f"{ENV}/python3", f"{ENV}/sglang", "version"], False),  # not `serve` first
    ([f"{ENV}/python3", f"{ENV}/sglang", "bench", "serve"], False),
    (["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "m"], False),
    (["/usr/local/bin/ollama", "serve"], False),
    (["/other/bin/python3", "/other/bin/sglang", "serve"], False),  # another environment's sglang
    (["python3", "-c", "pass", f"{ENV}/sglang", "serve"], False),
])
def test_sglang_serve_is_recognised_strictly(cmd, expected):
    assert agent.looks_like_server(ctx(), cmd) is expected


def test_a_configured_serve_launch_matches_only_itself():
    serve = ctx(launch=(f"{ENV}/sglang", "serve"), python="/usr/bin/python3")
    assert agent.looks_like_server(serve, [f"{ENV}/python3", f"{ENV}/sglang", "serve", "--port", "30000"])
    assert not agent.looks_like_server(serve, ["/usr/local/bin/vllm", "serve", "--port", "30000"])
    assert not agent.looks_like_server(serve, ["/usr/bin/python3", "/usr/local/bin/ollama", "serve"])


def test_the_port_of_a_config_yaml_and_the_command_line_winning(tmp_path):
    (tmp_path / "server.yaml").write_text("# hand-tuned\nmodel-path: /models/m  # the target\nport: 30001\n"
                                          "speculative_num_steps: 3\nenable-metrics: true\n")
    launch = ["python3", "-m", "sglang.launch_server", "--config", str(tmp_path / "server.yaml")]
    assert agent.looks_like_server(ctx(port=30001), launch)
    assert not agent.looks_like_server(ctx(port=30000), launch)  # not sglang's default: the YAML says 30001
    assert agent.looks_like_server(ctx(port=30000), [*launch, "--port", "30000"])  # the command line wins
    relative = ["python3", "-m", "sglang.launch_server", "--config", "server.yaml"]
    assert launchconfig.server_port(relative, str(tmp_path)) == "30001"  # read from the server's cwd
    assert launchconfig.server_port(relative, str(tmp_path / "elsewhere")) is None  # unreadable: unknown port
    merged = launchconfig.merged_argv([*launch, "--speculative-num-steps", "5"])
    assert merged[:6] == ["--model-path", "/models/m", "--port", "30001", "--speculative_num_steps", "3"]
    assert merged[-2:] == ["--speculative-num-steps", "5"]  # last: the command line wins in argparse
    with_switch = sglang.merge_config_args(launch, store_true={"enable_metrics"})
    assert with_switch[with_switch.index("--enable-metrics") + 1] == "python3"  # a switch, not `--flag true`


def test_the_flat_reader_agrees_with_pyyaml(tmp_path):
    import yaml
    text = ("model-path: '/models/with # hash'\nport: 30001\ntp: 8\nenable-metrics: true\ndisable-x: false\n"
            "log-level: ~\nchunked-prefill-size: 8192  # comment\nlist:\n  - a\n")
    flat = sglang._flat_yaml(text, "server.yaml")
    real = yaml.safe_load(text)
    assert {k: v for k, v in flat.items() if k != "list"} == {
        k: (v if isinstance(v, (bool, type(None))) else str(v)) for k, v in real.items() if k != "list"}
    with pytest.raises(ValueError, match="server.yaml line 1"):
        sglang._flat_yaml("just words\n", "server.yaml")


def test_another_environments_sglang_serve_is_named_with_how_to_configure_it():
    hint = agent._serve_hint(["/other/bin/python3", "/other/bin/sglang", "serve", "--port", "30000"])
    assert 'python = "/other/bin/python3"' in hint and '"/other/bin/sglang", "serve"' in hint
    assert agent._serve_hint(["/usr/bin/vllm", "serve"]) is None
