"""Arguments arrive byte for byte through every layer: Local, SSH, SSH → pct, SSH → pct → sh -c.

Each layer quotes exactly once (`sh_join` for the SSH login shell; pct hands argv to lxc-attach with
no shell). The property: whatever the arguments, the far `printf '%s\\0'` prints exactly them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynctl.transport.base import Transport
from dynctl.transport.local import Local
from dynctl.transport.pct import Pct
from sshd_harness import FakeHost

pytestmark = pytest.mark.slow

AWKWARD = [
    "", " ", "two words", "it's", 'say "hi"', "$HOME", "${PATH}", "$(id -u)", "`id`", "back\\slash",
    "trailing\\", "\\$HOME", "line\nbreak", "tab\there", "*", "~", ";", "&&", "|", "-n", "--", "!bang",
    "ünïcødé ✓ 日本", "'", '"', "\\", "$", "#hash", "a'b\"c$d`e\\f", "\r\n", "-c", "%s", "\x1b[31m",
]

# Any text but NUL (which no argv can hold) and lone surrogates (which are not UTF-8).
args_strategy = st.lists(
    st.one_of(
        st.sampled_from(AWKWARD),
        st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=24),
        st.text(alphabet=" '\"$`\\\n\t*?~!#;&|<>(){}[]=%-", max_size=12),
    ),
    max_size=8,
)

PRINT = ["printf", "%s\\0", "BEGIN"]
SH_PRINT = ["sh", "-c", 'printf "%s\\0" "$@"', "sh", "BEGIN"]


def expected(args: list[str]) -> bytes:
    return b"".join(a.encode() + b"\0" for a in ["BEGIN", *args])


@pytest.fixture(scope="module")
def layers(sshd: FakeHost) -> Iterator[dict[str, tuple[Transport, list[str]]]]:
    ssh = sshd.ssh()
    sshd.make_ct(150)
    pct = Pct(ssh, 150)
    yield {
        "local": (Local(), PRINT),
        "ssh": (ssh, PRINT),
        "ssh+pct": (pct, PRINT),
        "ssh+pct+sh": (pct, SH_PRINT),
    }
    ssh.close()


@pytest.mark.parametrize("layer", ["local", "ssh", "ssh+pct", "ssh+pct+sh"])
def test_awkward_table(layers, layer: str):
    transport, prefix = layers[layer]
    res = transport.run([*prefix, *AWKWARD])
    assert res.rc == 0, res.stderr
    assert res.out == expected(AWKWARD)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=args_strategy)
def test_any_arguments_arrive_byte_exact(layers, args: list[str]):
    for name, (transport, prefix) in layers.items():
        res = transport.run([*prefix, *args])
        assert (name, res.rc, res.out) == (name, 0, expected(args)), res.stderr


def test_naive_quoting_would_have_failed(layers):
    """Control: the same table with the inner layer quoted by hand is not byte exact."""
    transport, _ = layers["ssh"]
    naive = ["sh", "-c", "printf '%s\\0' BEGIN " + " ".join(AWKWARD)]
    assert transport.run(naive).out != expected(AWKWARD)
