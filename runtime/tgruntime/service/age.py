"""Encryption of exported files to age recipients (``save_weights_external``'s
``age_encryption_recipients``), with pyrage: the Python binding of rage, an implementation of
the age v1 format, and the same library ``tinker_cookbook.weights.download`` decrypts with.
Encryption is a library's job, not ours: no primitive is written here.

Recipients are X25519 keys (``age1...``, as ``age-keygen -y`` prints) or SSH public keys
(``ssh-ed25519 ...``, ``ssh-rsa ...``). Files stream through pyrage's ``encrypt_file`` (never
read whole into memory) into a hidden file beside the target, renamed when complete."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tgruntime.service.sessions import ServiceError

MAX_RECIPIENTS = 64


def _pyrage() -> Any:
    try:
        import pyrage
    except ImportError:
        raise ServiceError(
            "age_encryption_recipients: this server cannot encrypt (the Python package "
            "'pyrage' is not installed beside it); install it, or leave "
            "age_encryption_recipients unset"
        ) from None
    return pyrage


def recipient(text: Any) -> Any:
    """One pyrage recipient from an ``age1...`` or ``ssh-...`` public key; a 400 naming the
    field otherwise."""
    pyrage = _pyrage()
    if isinstance(text, str) and len(text) <= 16_384:
        kind = pyrage.ssh if text.startswith("ssh-") else pyrage.x25519
        try:
            return kind.Recipient.from_str(text.strip())
        except Exception:  # pyrage raises its own RecipientError or ValueError
            pass
    shown = repr(text)[:80]
    raise ServiceError(
        f"age_encryption_recipients: {shown} is not an age recipient: give X25519 keys "
        "(age1..., as `age-keygen -y` prints) or SSH public keys (ssh-ed25519 ..., ssh-rsa ...)"
    )


def check_recipients(raw: Any) -> list[Any]:
    """``age_encryption_recipients``: a list of 1-64 keys; a 400 otherwise."""
    if not isinstance(raw, list) or not raw or len(raw) > MAX_RECIPIENTS:
        raise ServiceError(
            f"age_encryption_recipients must be a list of 1 to {MAX_RECIPIENTS} age1... or "
            "ssh-... public keys"
        )
    return [recipient(r) for r in raw]


def encrypt_file(src: Path, dst: Path, recipients: list[Any]) -> int:
    """Encrypt ``src`` into ``dst`` (written beside it, then renamed) for every recipient;
    the bytes written."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    try:
        _pyrage().encrypt_file(str(src), str(tmp), recipients)
    except ServiceError:
        raise
    except Exception as e:  # an I/O or encryption failure, named
        tmp.unlink(missing_ok=True)
        raise ServiceError(f"could not encrypt {src.name}: {e}") from e
    os.replace(tmp, dst)
    return dst.stat().st_size
