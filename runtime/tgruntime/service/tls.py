"""HTTPS for the Tinker server: ``--tls-cert`` and ``--tls-key`` (PEM files; in Kubernetes the
``tls.crt`` and ``tls.key`` of the Secret ``spec.api.tls.secretName``, mounted by the operator).

With both, the server speaks only TLS (1.2 or newer) on its port: a plain-HTTP request is
not answered. The files are read at start-up (a bad pair fails the start, naming the flag)
and again whenever their mtime changes (checked every ``RELOAD_S``), so a certificate that
cert-manager renews in the Secret is served without a restart once the kubelet updates the
volume; a renewed pair that does not load is logged and the previous one kept."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
from dataclasses import dataclass

log = logging.getLogger("tgruntime.service")

RELOAD_S = 60.0


@dataclass(frozen=True, kw_only=True)
class TlsFiles:
    cert: str
    key: str

    def stamp(self) -> tuple[float, float]:
        return os.stat(self.cert).st_mtime, os.stat(self.key).st_mtime


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tls-cert",
        default=None,
        help="serve HTTPS with this PEM certificate (chain); needs --tls-key",
    )
    p.add_argument("--tls-key", default=None, help="the PEM private key of --tls-cert")


def from_args(args: argparse.Namespace) -> TlsFiles | None:
    return check_files(cert=args.tls_cert, key=args.tls_key)


def check_files(*, cert: str | None, key: str | None) -> TlsFiles | None:
    """None (plain HTTP) when neither is given; else both, each a readable file."""
    if not cert and not key:
        return None
    if not cert or not key:
        given, missing = ("--tls-cert", "--tls-key") if cert else ("--tls-key", "--tls-cert")
        raise ValueError(f"{given} needs {missing} too (a certificate and its private key)")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ValueError(f"{flag} {path}: not a readable file")
    files = TlsFiles(cert=cert, key=key)
    server_context(files)  # fails now, naming the flags, rather than at the first client
    return files


def server_context(files: TlsFiles) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    load(ctx, files)
    return ctx


def load(ctx: ssl.SSLContext, files: TlsFiles) -> None:
    try:
        ctx.load_cert_chain(files.cert, files.key)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"--tls-cert {files.cert} / --tls-key {files.key}: cannot load them as a PEM "
            f"certificate and its private key ({exc})"
        ) from None


async def reload_loop(ctx: ssl.SSLContext, files: TlsFiles, every_s: float = RELOAD_S) -> None:
    """Load the pair again into ``ctx`` when the files change (new handshakes use it)."""
    stamp = files.stamp()
    while True:
        await asyncio.sleep(every_s)
        try:
            now = files.stamp()
            if now != stamp:
                load(ctx, files)
                stamp = now
                log.warning("TLS certificate %s reloaded (it changed on disk)", files.cert)
        except (OSError, ValueError) as exc:
            log.warning("TLS certificate reload failed, the previous one is served: %s", exc)
