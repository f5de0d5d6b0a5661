"""Test certificates made with `cryptography`: a CA, server and client certificates it signs
(valid now, or expired), and a second CA nobody trusts. PEM files in a directory."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Pair:
    cert: Path
    key: Path


class Authority:
    """A CA writing its certificate and the certificates it signs under `directory`."""

    def __init__(self, directory: Path, name: str = "otelgpu test CA") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.name = directory, name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(days=1))
                      .not_valid_after(now + datetime.timedelta(days=30))
                      .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                      .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                   content_commitment=False, key_encipherment=False,
                                                   data_encipherment=False, key_agreement=False,
                                                   encipher_only=False, decipher_only=False), critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.cert = directory / f"{_slug(name)}.crt"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, server: bool = True, expired: bool = False,
              hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1"), file: Optional[str] = None) -> Pair:
        """A certificate for `name` (a server's, for `hosts`; or a client's) and its key."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        start, end = ((now - datetime.timedelta(days=10), now - datetime.timedelta(days=1)) if expired
                      else (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=7)))
        names = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in hosts]
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                   .issuer_name(self._cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                         else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        stem = file or _slug(name)
        pair = Pair(self.directory / f"{stem}.crt", self.directory / f"{stem}.key")
        pair.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return pair

    def serial_of(self, pem: bytes) -> int:
        return x509.load_pem_x509_certificate(pem).serial_number


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())


def served_serial(port: int, ca_cert: Path, alpn: tuple[str, ...] = ()) -> int:
    """The serial number of the certificate a new TLS connection to localhost:`port` is handed
    (`alpn`: ("h2",) for a gRPC server)."""
    context = ssl.create_default_context(cafile=str(ca_cert))
    if alpn:
        context.set_alpn_protocols(list(alpn))
    with socket.create_connection(("localhost", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def rotate_through_a_half_done_rotation(ca: Authority, server: Pair, served: Callable[[], int],
                                        reload_errors: Callable[[], int], poll: Callable) -> Pair:
    """Rotate `server`'s files in place as a careless rotation would: first a new certificate with
    the old key, which must be kept out (the old certificate still `served()`, the refusal counted
    in `reload_errors()`), then the new key; returns the new pair once `served()` hands it out."""
    first = served()
    key = server.key.read_bytes()
    rotated = ca.issue("otelgpu", file=server.cert.stem)  # writes the new certificate and key over the old ones
    new_key = rotated.key.read_bytes()
    server.key.write_bytes(key)
    assert served() == first
    assert reload_errors() >= 1
    server.key.write_bytes(new_key)  # the rotation completes
    assert poll(lambda: served() != first, 10)
    assert served() == ca.serial_of(rotated.cert.read_bytes())
    return rotated
