"""A throwaway certificate authority for the TLS tests: a CA, and server certificates it signs for the names and
addresses the tests connect to. Nothing here is for production (docs/reliability.md shows that set-up)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["Pki", "make_pki"]


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA certificate devices and the server verify against (PEM)
    cert: Path  # a server certificate signed by the CA (PEM)
    key: Path  # its private key (PEM, unencrypted, 0600)
    other_ca: Path  # a second, unrelated CA: a client trusting only this one must refuse the server


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_pki(folder: str | Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Pki:
    """A CA and a server certificate for ``hosts`` (IP addresses or DNS names) under ``folder``."""
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("pfl-edge test CA")
    _, other = _ca("someone else's CA")
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (d / "ca.pem").write_bytes(ca_cert.public_bytes(pem))
    (d / "other-ca.pem").write_bytes(other.public_bytes(pem))
    (d / "server.pem").write_bytes(cert.public_bytes(pem))
    key_path = d / "server.key"
    key_path.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    os.chmod(key_path, 0o600)
    return Pki(d / "ca.pem", d / "server.pem", key_path, d / "other-ca.pem")
