"""The local cluster's credentials: one CA, the apiserver's serving certificate, a client certificate per
identity (admin, controller-manager, scheduler, kubelet), the service-account key, and their kubeconfigs."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any


def write_pki(pki: Path, node_name: str) -> None:
    """CA, apiserver serving cert, one client cert per identity, SA signing key."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    pki.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    later = now + dt.timedelta(days=30)

    def write_key(name: str, key: Any) -> None:
        (pki / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        os.chmod(pki / f"{name}.key", 0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "topodra-local-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(later)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    write_key("ca", ca_key)
    (pki / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def issue(name: str, cn: str, orgs: tuple[str, ...] = (), server: bool = False) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
        b = (x509.CertificateBuilder().subject_name(x509.Name(attrs)).issuer_name(ca_name)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now).not_valid_after(later)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(
                 [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]),
                 critical=False))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
                x509.DNSName("localhost"), x509.DNSName("kubernetes"),
                x509.DNSName("kubernetes.default"), x509.DNSName("kubernetes.default.svc"),
                x509.DNSName("kubernetes.default.svc.cluster.local")]), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        write_key(name, key)
        (pki / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    issue("apiserver", "kube-apiserver", server=True)
    issue("admin", "topodra-admin", ("system:masters",))
    issue("kube-controller-manager", "system:kube-controller-manager")
    issue("kube-scheduler", "system:kube-scheduler")
    issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", ("system:masters",))
    issue("node", f"system:node:{node_name}", ("system:nodes",))
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    write_key("sa", sa)
    (pki / "sa.pub").write_bytes(sa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def write_kubeconfig(path: Path, pki: Path, ident: str, apiserver_port: int = 6443) -> None:
    cfg = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": {
            "server": f"https://127.0.0.1:{apiserver_port}", "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": ident, "user": {
            "client-certificate": str(pki / f"{ident}.crt"), "client-key": str(pki / f"{ident}.key")}}],
        "contexts": [{"name": ident, "context": {"cluster": "local", "user": ident}}],
        "current-context": ident,
    }
    path.write_text(json.dumps(cfg, indent=2))  # JSON is valid YAML
