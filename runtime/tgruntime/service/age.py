"""Encryption of exported files to age recipients (``save_weights_external``'s
``age_encryption_recipients``), written from the age v1 format's public specification
(C2SP ``age``): native X25519 recipients (``age1...``), a random 16-byte file key wrapped once
per recipient, the header's HMAC, and the payload in 64 KiB ChaCha20-Poly1305 chunks (STREAM).
Any age implementation (``age -d``, rage, pyrage: what ``tinker_cookbook.weights.download``
decrypts with) reads the files.

Only X25519 recipients are taken; SSH keys are refused with the reason. Primitives come from
``cryptography`` (imported when a request asks for encryption)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from pathlib import Path
from typing import Any

from tgruntime.service.sessions import ServiceError

CHUNK = 64 * 1024
_CHARSET = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"
_INTRO = b"age-encryption.org/v1\n"
MAX_RECIPIENTS = 64


def _b64(data: bytes) -> bytes:
    return base64.b64encode(data).rstrip(b"=")


def _polymod(values: list[int]) -> int:
    gen = (0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3)
    chk = 1
    for v in values:
        top = chk >> 25
        chk = (chk & 0x1FFFFFF) << 5 ^ v
        for i in range(5):
            chk ^= gen[i] if (top >> i) & 1 else 0
    return chk


def recipient_key(text: str) -> bytes:
    """The 32-byte X25519 public key of an ``age1...`` recipient (Bech32, as age writes
    them); a 400 naming the field otherwise."""
    bad = ServiceError(
        f"age_encryption_recipients: {text[:80]!r} is not an age X25519 recipient (age1..., "
        "as `age-keygen -y` prints); SSH keys are not supported here"
    )
    if not isinstance(text, str) or len(text) > 200 or text.lower() != text:
        raise bad
    hrp, sep, data = text.rpartition("1")
    if hrp != "age" or not sep or len(data) < 6 or any(c not in _CHARSET for c in data):
        raise bad
    values = [_CHARSET.index(c) for c in data]
    expanded = [ord(c) >> 5 for c in hrp] + [0] + [ord(c) & 31 for c in hrp]
    if _polymod(expanded + values) != 1:
        raise bad
    acc, bits, out = 0, 0, bytearray()
    for v in values[:-6]:
        acc = (acc << 5) | v
        bits += 5
        if bits >= 8:
            bits -= 8
            out.append((acc >> bits) & 0xFF)
    if len(out) != 32 or bits >= 5 or (acc & ((1 << bits) - 1)):
        raise bad
    return bytes(out)


def _hkdf(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(ikm)


def _stanza(file_key: bytes, recipient: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.x25519 import (
        X25519PrivateKey,
        X25519PublicKey,
    )
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    eph = X25519PrivateKey.generate()
    share = eph.public_key().public_bytes_raw()
    secret = eph.exchange(X25519PublicKey.from_public_bytes(recipient))
    if secret == bytes(32):
        raise ServiceError("age_encryption_recipients: a recipient key is a low-order point")
    wrap = _hkdf(secret, share + recipient, b"age-encryption.org/v1/X25519")
    body = ChaCha20Poly1305(wrap).encrypt(bytes(12), file_key, None)
    lines = [body[i : i + 48] for i in range(0, len(body), 48)]
    if len(body) % 48 == 0:
        lines.append(b"")  # a body's last line is shorter than 64 columns, maybe empty
    return b"-> X25519 " + _b64(share) + b"\n" + b"".join(_b64(x) + b"\n" for x in lines)


def encrypt_file(src: Path, dst: Path, recipients: list[bytes]) -> int:
    """Encrypt ``src`` into ``dst`` (written beside it, then renamed) for every recipient;
    the bytes written."""
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    file_key = os.urandom(16)
    header = _INTRO + b"".join(_stanza(file_key, r) for r in recipients) + b"---"
    mac = hmac.new(_hkdf(file_key, b"", b"header"), header, hashlib.sha256).digest()
    nonce = os.urandom(16)
    aead = ChaCha20Poly1305(_hkdf(file_key, nonce, b"payload"))
    tmp = dst.with_name(f".{dst.name}.tmp")
    size = src.stat().st_size
    with src.open("rb") as fin, tmp.open("wb") as fout:
        fout.write(header + b" " + _b64(mac) + b"\n" + nonce)
        counter, done = 0, 0
        while True:
            chunk = fin.read(CHUNK)
            done += len(chunk)
            last = done >= size
            fout.write(
                aead.encrypt(counter.to_bytes(11, "big") + (b"\x01" if last else b"\x00"),
                             chunk, None)
            )
            counter += 1
            if last:
                break
    os.replace(tmp, dst)
    return dst.stat().st_size


def check_recipients(raw: Any) -> list[bytes]:
    """``age_encryption_recipients``: a list of 1-64 ``age1...`` keys; a 400 otherwise. Also
    checks that ``cryptography`` is importable (a 400 naming the package when not)."""
    if not isinstance(raw, list) or not raw or len(raw) > MAX_RECIPIENTS:
        raise ServiceError(
            f"age_encryption_recipients must be a list of 1 to {MAX_RECIPIENTS} age1... keys"
        )
    keys = [recipient_key(r) for r in raw]
    try:
        import cryptography.hazmat.primitives.ciphers.aead  # noqa: F401
    except ImportError:
        raise ServiceError(
            "age_encryption_recipients: this server cannot encrypt (the Python package "
            "'cryptography' is not installed beside it); install it, or leave "
            "age_encryption_recipients unset"
        ) from None
    return keys
