"""OpenSSH host certificates (PROTOCOL.certkeys): read one, and say why it cannot vouch for a host.

paramiko negotiates `*-cert-v01@openssh.com` host keys and checks the key exchange with the key inside,
but leaves the certificate itself unread; this module checks it the way OpenSSH's client does
(sshconnect.c check_host_cert): a host certificate, signed by the CA, valid now, naming the host among
its principals (or naming none), with no critical options.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import paramiko

CERT_SUFFIX = "-cert-v01@openssh.com"
_HOST_CERT = 2
_FOREVER = 0xFFFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class HostCertificate:
    key_id: str
    serial: int
    cert_type: int
    principals: tuple[str, ...]
    valid_after: int
    valid_before: int
    critical_options: bytes
    ca_key: paramiko.PKey
    signed: bytes
    signature: bytes

    def problem(self, hostname: str, now: float | None = None) -> str | None:
        """Why this certificate does not vouch for `hostname`; None when it does."""
        if self.cert_type != _HOST_CERT:
            return f"certificate '{self.key_id}' is a user certificate, not a host certificate"
        sig_type = paramiko.Message(self.signature).get_text()
        if sig_type == "ssh-rsa":  # OpenSSH's CASignatureAlgorithms has refused SHA-1 since 8.2
            return f"certificate '{self.key_id}' is signed with ssh-rsa (SHA-1), which is no longer accepted"
        if not self.ca_key.verify_ssh_sig(self.signed, paramiko.Message(self.signature)):
            return f"certificate '{self.key_id}' has a signature that does not verify with its CA key"
        now = time.time() if now is None else now
        if now < self.valid_after:
            return f"certificate '{self.key_id}' is not valid before {_utc(self.valid_after)}"
        if self.valid_before != _FOREVER and now >= self.valid_before:
            return f"certificate '{self.key_id}' expired at {_utc(self.valid_before)}"
        if self.principals and hostname.lower() not in self.principals:
            return (f"certificate '{self.key_id}' is for {', '.join(self.principals)}, not for "
                    f"{hostname}")
        if self.critical_options:
            return f"certificate '{self.key_id}' has critical options, which no host certificate may carry"
        return None


def host_certificate(key: paramiko.PKey) -> HostCertificate | None:
    """The certificate a server presented with `key`, or None for a plain host key.

    Raises ValueError when the certificate cannot be read (a malformed or unsupported one).
    """
    blob = getattr(key, "public_blob", None)
    if blob is None or not str(blob.key_type).endswith(CERT_SUFFIX):
        return None
    try:
        return _parse(bytes(blob.key_blob))
    except (paramiko.SSHException, ValueError, TypeError, IndexError, OverflowError) as err:
        raise ValueError(f"unreadable {blob.key_type} certificate: {err or type(err).__name__}") from None


def _parse(blob: bytes) -> HostCertificate:
    m = paramiko.Message(blob)
    cert_type = m.get_text()
    m.get_string()  # nonce
    plain = cert_type[: -len(CERT_SUFFIX)]
    if plain == "ssh-ed25519":
        m.get_string()
    elif plain.startswith("ecdsa-sha2-"):
        m.get_text()
        m.get_string()
    elif plain == "ssh-rsa":
        m.get_mpint()
        m.get_mpint()
    else:
        raise ValueError(f"certificate type {cert_type} is not supported")
    serial = m.get_int64()
    kind = m.get_int()
    key_id = m.get_text()
    principals = _strings(m.get_string())
    valid_after = m.get_int64()
    valid_before = m.get_int64()
    critical = m.get_string()
    m.get_string()  # extensions: none is defined for host certificates, and none needs honouring
    m.get_string()  # reserved
    ca_blob = m.get_string()
    signed = m.get_so_far()
    signature = m.get_string()
    ca_key = paramiko.PKey.from_type_string(paramiko.Message(ca_blob).get_text(), ca_blob)
    return HostCertificate(key_id=key_id, serial=serial, cert_type=kind,
                           principals=tuple(p.lower() for p in principals), valid_after=valid_after,
                           valid_before=valid_before, critical_options=critical, ca_key=ca_key, signed=signed,
                           signature=signature)


def _strings(packed: bytes) -> list[str]:
    m = paramiko.Message(packed)
    out = []
    while m.get_remainder():
        out.append(m.get_text())
    return out


def _utc(seconds: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))
