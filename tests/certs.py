"""Certificates made in the test with ``cryptography``: a CA, and leaf certificates it signs for
127.0.0.1 / localhost (servers) or a common name (clients). ``pki(dir)`` writes them as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Pair:
    cert: str  # PEM file paths
    key: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pair:
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return Pair(str(cert_path), str(key_path))


class Authority:
    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = _write(directory, name, self.cert, self.key).cert

    def issue(self, cn: str, *, server: bool, expired: bool = False) -> Pair:
        """A certificate for ``cn``, valid for a day (``expired``: until yesterday)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=2 if expired else 0)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if server:
            sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
            usage = ExtendedKeyUsageOID.SERVER_AUTH
        else:
            usage = ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return _write(self.directory, cn, builder.sign(self.key, hashes.SHA256()), key)


@dataclass
class Pki:
    ca: str  # the trusted CA's PEM
    server: Pair  # for 127.0.0.1 / localhost
    clients: dict[str, Pair]  # by common name, signed by the CA
    rogue: Pair  # a client certificate named "ops", as the admin's, but signed by another CA


def pki(directory: Path, clients: tuple[str, ...] = ("ops", "alice", "host")) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = Authority(directory, "test-ca")
    (directory / "rogue").mkdir(exist_ok=True)
    rogue = Authority(directory / "rogue", "rogue-ca")
    return Pki(
        ca=ca.pem,
        server=ca.issue("server", server=True),
        clients={cn: ca.issue(cn, server=False) for cn in clients},
        rogue=rogue.issue("ops", server=False),
    )
