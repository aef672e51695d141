"""known_hosts as OpenSSH reads it, against a real sshd: @cert-authority with host certificates made by
ssh-keygen, @revoked, hashed names, wildcards and negation, and lines dynctl cannot read.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from dynctl.base.errors import HostKeyError
from dynctl.transport.host_cert import CERT_SUFFIX
from dynctl.transport.known_hosts import host_matches
from sshd_harness import FakeHost


def keygen(*args: str) -> None:
    subprocess.run(["ssh-keygen", "-q", *args], check=True, capture_output=True, stdin=subprocess.DEVNULL)


def make_key(path: Path, kind: str = "ed25519") -> Path:
    keygen("-t", kind, "-N", "", "-C", "", "-f", str(path))
    return path


def pub(path: Path) -> str:
    """`type base64` of a key (its .pub without the comment)."""
    return " ".join(Path(f"{path}.pub").read_text().split()[:2])


def fp(path: Path) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", f"{path}.pub"], capture_output=True, text=True, check=True).stdout
    return out.split()[1]


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> Path:
    return make_key(tmp_path_factory.mktemp("ca") / "ca")


@pytest.fixture
def cert_host(sshd_factory, ca):
    """Start an sshd presenting a host certificate for its key, signed by `signer` (default: the CA)."""

    def start(principals: str = "127.0.0.1", validity: str = "-5m:+1h", signer: Path | None = None) -> FakeHost:
        def certify(host_key: Path) -> str:
            keygen("-s", str(signer or ca), "-I", "dynctl-test-host", "-h", "-n", principals, "-V", validity,
                   f"{host_key}.pub")
            return f"HostCertificate {host_key}-cert.pub\n"

        return sshd_factory(extra_config=certify)

    return start


def known_hosts(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "known_hosts"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def connect(host: FakeHost, kh: str, **kw):
    t = host.ssh(known_hosts_path=kh, **kw)
    assert t.run(["true"]).rc == 0
    return t


# ---- @cert-authority


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["*", "[127.0.0.1]:*", "[127.0.0.*]:*,!example.org"])
def test_a_host_certificate_signed_by_a_trusted_ca_is_accepted(cert_host, ca, tmp_path, pattern):
    host = cert_host()
    kh = known_hosts(tmp_path, f"@cert-authority {pattern} {pub(ca)}")  # the host's own key is nowhere
    t = connect(host, kh)
    assert t.connect().host_key_type.endswith(CERT_SUFFIX)  # offered first because a CA is trusted
    assert Path(kh).read_text().count("\n") == 1  # nothing was added anywhere


@pytest.mark.slow
def test_cert_authority_in_the_users_known_hosts_works_from_the_cli(cert_host, ca, tmp_path, isolated_home):
    """The marker used to make every command exit 2 ("unreadable known_hosts file")."""
    host = cert_host()
    (isolated_home / ".ssh" / "known_hosts").write_text(
        f"# fleet CA\n@cert-authority * {pub(ca)}\n@revoked * {pub(make_key(tmp_path / 'old'))}\n")
    config = host.write_config(tmp_path / "dynctl.toml", {"box": {"ssh": host.target, "python": sys.executable}})
    config.with_name("dynctl.known_hosts").write_text("")  # dynctl's own file trusts nothing
    out = subprocess.run([sys.executable, "-m", "dynctl", "status", "--json", "--config", str(config)],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["host"]["reachable"] is True


@pytest.mark.parametrize(("principals", "validity", "fragment"), [
    ("10.9.9.9,gpu.example", "-5m:+1h", "is for 10.9.9.9, gpu.example, not for 127.0.0.1"),
    ("127.0.0.1", "-2h:-1h", "expired at"),
    ("127.0.0.1", "+1h:+2h", "is not valid before"),
])
@pytest.mark.slow
def test_an_invalid_certificate_from_a_trusted_ca_is_refused(cert_host, ca, tmp_path, principals, validity,
                                                             fragment):
    host = cert_host(principals, validity)
    # Even with the plain key trusted too: OpenSSH refuses a certificate its CA vouches for but that is invalid.
    kh = known_hosts(tmp_path, f"@cert-authority * {pub(ca)}", host.host_key_line)
    with pytest.raises(HostKeyError) as info:
        host.ssh(known_hosts_path=kh, accept_new=True).run(["true"])
    message = str(info.value)
    assert "host certificate" in message and fragment in message and "refusing to connect" in message
    assert f"{kh}:1" in message
    assert info.value.exit_code == 4


@pytest.mark.slow
def test_a_certificate_from_an_untrusted_ca_falls_back_to_the_plain_key(cert_host, ca, tmp_path):
    rogue = make_key(tmp_path / "rogue_ca")
    host = cert_host(signer=rogue)
    kh = known_hosts(tmp_path, f"@cert-authority * {pub(ca)}")
    with pytest.raises(HostKeyError) as info:
        host.ssh(known_hosts_path=kh).run(["true"])
    message = str(info.value)
    assert "unknown host key" in message and fp(rogue) in message and "no @cert-authority line trusts" in message
    assert fp(host.tmp / "host_ed25519") in message
    # The plain key, once known, is enough (as for OpenSSH).
    connect(host, known_hosts(tmp_path, f"@cert-authority * {pub(ca)}", host.host_key_line))


# ---- @revoked


@pytest.mark.slow
def test_a_revoked_key_is_refused_even_when_also_trusted(sshd: FakeHost, tmp_path):
    key = sshd.tmp / "host_ed25519"
    kh = known_hosts(tmp_path, sshd.host_key_line, f"@revoked * {pub(key)}")
    before = Path(kh).read_bytes()
    with pytest.raises(HostKeyError) as info:
        sshd.ssh(known_hosts_path=kh, accept_new=True).run(["true"])
    message = str(info.value)
    assert "marked @revoked" in message and f"{kh}:2" in message and fp(key) in message
    assert info.value.exit_code == 4
    assert Path(kh).read_bytes() == before


@pytest.mark.slow
def test_a_revoked_ca_vouches_for_nothing(cert_host, ca, tmp_path):
    host = cert_host()
    kh = known_hosts(tmp_path, f"@cert-authority * {pub(ca)}", f"@revoked * {pub(ca)}")
    with pytest.raises(HostKeyError, match=r"signed by CA .* which is marked @revoked"):
        host.ssh(known_hosts_path=kh).run(["true"])


@pytest.mark.slow
def test_revoked_applies_only_to_the_hosts_it_names(sshd: FakeHost, tmp_path):
    kh = known_hosts(tmp_path, sshd.host_key_line, f"@revoked other.example {pub(sshd.tmp / 'host_ed25519')}")
    connect(sshd, kh)


# ---- patterns


@pytest.mark.slow
def test_hashed_names_are_matched(sshd: FakeHost, tmp_path):
    kh = known_hosts(tmp_path, sshd.host_key_line)
    keygen("-H", "-f", kh)
    assert "|1|" in Path(kh).read_text() and "127.0.0.1" not in Path(kh).read_text()
    connect(sshd, kh)


@pytest.mark.slow
def test_wildcards_and_negation(sshd: FakeHost, tmp_path):
    key = pub(sshd.tmp / "host_ed25519")
    connect(sshd, known_hosts(tmp_path, f"[127.0.0.?]:{sshd.port} {key}"))
    with pytest.raises(HostKeyError, match="unknown host key"):
        sshd.ssh(known_hosts_path=known_hosts(tmp_path, f"[127.0.0.*]:*,![127.0.0.1]:{sshd.port} {key}")).run(["true"])


@pytest.mark.parametrize(("patterns", "name", "expected"), [
    (["[10.0.0.1]:2222"], "[10.0.0.1]:2222", True),
    (["[10.0.0.1]:2222"], "[10.0.0.1]:22", False),
    (["10.0.0.1"], "[10.0.0.1]:2222", False),  # a non-standard port is only matched in [host]:port form
    (["*.example.org"], "GPU.Example.org", True),
    (["*.example.org", "!bad.example.org"], "bad.example.org", False),
    (["!bad.example.org"], "good.example.org", False),  # negation alone matches nothing
    (["gpu?.example.org"], "gpu12.example.org", False),
])
def test_pattern_semantics(patterns, name, expected):
    assert host_matches(patterns, name) is expected


@pytest.mark.slow
def test_only_the_known_key_type_is_asked_for(sshd_factory, tmp_path):
    """With only its RSA key known, a host that also has an ed25519 key must be asked for the RSA one."""
    def add_rsa(host_key: Path) -> str:
        make_key(host_key.with_name("host_rsa"), "rsa")
        return f"HostKey {host_key.with_name('host_rsa')}\n"

    host = sshd_factory(extra_config=add_rsa)
    t = connect(host, known_hosts(tmp_path, f"[127.0.0.1]:{host.port} {pub(host.tmp / 'host_rsa')}"))
    assert t.connect().host_key_type.startswith("rsa-sha2-")


# ---- lines dynctl cannot read


@pytest.mark.slow
def test_lines_it_cannot_read_are_skipped_with_a_warning(sshd: FakeHost, tmp_path, caplog):
    """Broken lines are named; a key is decoded only for lines about this host, so only those are checked."""
    me = f"[127.0.0.1]:{sshd.port}"
    kh = known_hosts(
        tmp_path,
        "@future-marker * ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDWxPNsKQAbE0cIjtt8Th08oYlSOvAb9qzRjGlwsoGh6",
        "just-a-name",
        f"{me} ssh-ed25519 not%base64",
        f"{me} sk-ssh-ed25519@openssh.com AAAAGnNrLXNzaC1lZDI1NTE5QG9wZW5zc2guY29t",
        "other.example ssh-ed25519 not%base64",
        sshd.host_key_line,
    )
    with caplog.at_level(logging.WARNING, logger="dynctl.ssh"):
        connect(sshd, kh)
    warnings = [r.getMessage() for r in caplog.records if r.name == "dynctl.ssh"]
    for lineno, why in [(1, "unknown marker '@future-marker'"), (2, "expected host patterns"),
                        (3, "not valid base64"), (4, "'sk-ssh-ed25519@openssh.com' is not supported")]:
        named = [w for w in warnings if w.startswith(f"{kh} line {lineno}: ")]
        assert named and why in named[0] and named[0].endswith("line skipped"), (lineno, warnings)
    assert not any(f"{kh} line 5:" in w for w in warnings)
