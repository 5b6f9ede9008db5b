"""Test certificates made with the `openssl` binary: a private CA, a server certificate for
127.0.0.1/localhost, client certificates (good, expired, signed by another CA, with a
directoryName SAN), a server certificate from another CA."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN=gpuguard test {name}",
             # What Python 3.13's default contexts (VERIFY_X509_STRICT) require of a CA.
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def _leaf(d: Path, name: str, ca: str, *, server: bool, days: int = 2,
          not_after: str | None = None, sans: str | None = None) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    ext = d / f"{name}.ext"
    ext.write_text(("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
                    if server else (f"subjectAltName={sans}\n" if sans else "")
                    + "extendedKeyUsage=clientAuth\n")
                   # RFC 5280's, which Python 3.13's default contexts check (X509_STRICT).
                   + "authorityKeyIdentifier=keyid,issuer\nsubjectKeyIdentifier=hash\n"
                   # What a `dirName:dir_sect` SAN names (a directoryName, not a string).
                   + "[dir_sect]\nO=gpuguard test\nCN=prometheus.example\n")
    if not_after is None:
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey",
                 f"{ca}.key", "-CAcreateserial", "-out", f"{name}.crt", "-days", str(days),
                 "-extfile", ext.name, cwd=d)
    else:  # an already expired certificate: `openssl ca` can set both dates
        conf = d / f"{name}.cnf"
        conf.write_text(
            "[ca]\ndefault_ca=c\n[c]\ndatabase=index.txt\nnew_certs_dir=.\n"
            f"certificate={ca}.crt\nprivate_key={ca}.key\ndefault_md=sha256\npolicy=p\n"
            "serial=serial\n[p]\ncommonName=supplied\n")
        (d / "index.txt").write_text("")
        (d / "serial").write_text("1000\n")
        _openssl("ca", "-batch", "-config", conf.name, "-in", f"{name}.csr", "-out",
                 f"{name}.crt", "-startdate", "20200101000000Z", "-enddate", not_after,
                 "-extfile", ext.name, "-notext", cwd=d)


@dataclass(frozen=True)
class Certs:
    dir: Path

    def path(self, name: str) -> str:
        return str(self.dir / name)


def make_certs(d: Path) -> Certs:
    """ca.{crt,key}, server.{crt,key} (signed by ca), server2.* (a second server
    certificate, for rotation), client.* (good, no SAN), named.* (good, SANs
    DNS:prometheus.example and email:ops@example.com), dirname.* (good, one directoryName
    SAN, CN=prometheus.example: no string SAN), dirname-named.* (good, that directoryName
    SAN first, then DNS:prometheus.example), expired.* (expired), other-ca.* and
    stranger.* (a client certificate from another CA), other-server.* (a server certificate
    for 127.0.0.1/localhost from that other CA)."""
    if shutil.which("openssl") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("openssl not installed: apt-get install openssl")
        pytest.skip("openssl not installed")
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "server", "ca", server=True)
    _leaf(d, "server2", "ca", server=True)
    _leaf(d, "client", "ca", server=False)
    _leaf(d, "named", "ca", server=False, sans="DNS:prometheus.example,email:ops@example.com")
    _leaf(d, "dirname", "ca", server=False, sans="dirName:dir_sect")
    _leaf(d, "dirname-named", "ca", server=False, sans="dirName:dir_sect,DNS:prometheus.example")
    _leaf(d, "expired", "ca", server=False, not_after="20200102000000Z")
    _leaf(d, "stranger", "other-ca", server=False)
    _leaf(d, "other-server", "other-ca", server=True)
    return Certs(d)
