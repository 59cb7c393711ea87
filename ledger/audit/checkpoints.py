"""Checkpoints: the ledger's Merkle tree at one size, signed with Ed25519 (contract §7).

A checkpoint states five things, and its signature covers exactly these bytes (ASCII, each
line ending in a newline):

    waybill-checkpoint/v1
    <tree size, decimal>
    <root hash, 64 lowercase hex digits>
    <ledger head hash at that size: the hash chain's hash of the event at position size>
    <time, UTC, 2026-05-01T12:00:00.123456Z>
    <key id>

The key id is the first 16 hex digits of SHA-256 over the raw 32-byte public key, so a
verifier holding several public keys (a rotation) knows which one a checkpoint needs. A
checkpoint is one line of JSON in the sink, the canonical form of its fields (sorted keys,
no spaces) and nothing else: a line that is not exactly that form is refused, so no byte of
a checkpoint file can change unnoticed.

Keys are PEM files: the private key PKCS #8 (``.key``, never in the database or an event),
the public key SubjectPublicKeyInfo (``.pub``), as ``openssl pkey`` writes and reads them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "FORMAT",
    "Checkpoint",
    "CheckpointFormatError",
    "KeyFileError",
    "PublicKeys",
    "SigningKey",
    "checkpoint_from_json",
    "checkpoint_from_line",
    "format_time",
    "generate_key",
    "key_id_of",
    "load_public_key",
    "load_signing_key",
    "signed_message",
]

FORMAT: Final = "waybill-checkpoint/v1"
_HASH: Final = re.compile(r"[0-9a-f]{64}")
_KEY_ID: Final = re.compile(r"[0-9a-f]{16}")
_SIGNATURE: Final = re.compile(r"[0-9a-f]{128}")
_TIME: Final = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
_FIELDS: Final = frozenset({"format", "size", "root", "head_hash", "time", "key_id", "signature"})


class CheckpointFormatError(ValueError):
    """Not a checkpoint in the canonical form."""


class KeyFileError(ValueError):
    """A key file that is not the Ed25519 PEM key it should be."""


def format_time(moment: datetime) -> str:
    """A checkpoint's time: UTC, microseconds, ``Z``."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def signed_message(size: int, root: str, head_hash: str, time: str, key_id: str) -> bytes:
    """The bytes a checkpoint's signature covers (see the module docstring)."""
    return f"{FORMAT}\n{size}\n{root}\n{head_hash}\n{time}\n{key_id}\n".encode("ascii")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    size: int
    root: str
    head_hash: str
    time: str
    key_id: str
    signature: str

    def message(self) -> bytes:
        return signed_message(self.size, self.root, self.head_hash, self.time, self.key_id)

    def as_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "size": self.size,
            "root": self.root,
            "head_hash": self.head_hash,
            "time": self.time,
            "key_id": self.key_id,
            "signature": self.signature,
        }

    def line(self) -> bytes:
        """The sink's line: canonical JSON and a newline."""
        return orjson.dumps(self.as_json(), option=orjson.OPT_SORT_KEYS) + b"\n"

    @property
    def moment(self) -> datetime:
        return datetime.strptime(self.time, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)


def checkpoint_from_json(value: Any) -> Checkpoint:
    """A checkpoint from its JSON object, every field checked for its exact form."""
    if not isinstance(value, dict) or set(value) != _FIELDS:
        raise CheckpointFormatError(f"a checkpoint has exactly the fields {sorted(_FIELDS)}")
    if value["format"] != FORMAT:
        raise CheckpointFormatError(f"format is not {FORMAT!r}")
    size = value["size"]
    if type(size) is not int or size < 1:
        raise CheckpointFormatError("size is not a positive integer")
    for name, pattern in (
        ("root", _HASH),
        ("head_hash", _HASH),
        ("key_id", _KEY_ID),
        ("signature", _SIGNATURE),
        ("time", _TIME),
    ):
        field = value[name]
        if not isinstance(field, str) or not pattern.fullmatch(field):
            raise CheckpointFormatError(f"{name} is not in its form ({pattern.pattern})")
    try:
        datetime.strptime(value["time"], "%Y-%m-%dT%H:%M:%S.%fZ")
    except ValueError:
        raise CheckpointFormatError("time is not a real instant") from None
    return Checkpoint(
        size, value["root"], value["head_hash"], value["time"], value["key_id"], value["signature"]
    )


def checkpoint_from_line(line: bytes) -> Checkpoint:
    """A checkpoint from a sink line (without its newline), refused unless canonical."""
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise CheckpointFormatError("not JSON") from None
    checkpoint = checkpoint_from_json(value)
    if checkpoint.line() != line + b"\n":
        raise CheckpointFormatError("not in the canonical form (sorted keys, no spaces)")
    return checkpoint


# --- keys ----------------------------------------------------------------------------------


def key_id_of(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


class SigningKey:
    """The private key that signs checkpoints; its repr never shows it."""

    __slots__ = ("_private", "key_id", "public")

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public = private.public_key()
        self.key_id = key_id_of(self.public)

    def __repr__(self) -> str:
        return f"SigningKey(key_id={self.key_id!r})"

    def sign(self, size: int, root: str, head_hash: str, time: str) -> Checkpoint:
        message = signed_message(size, root, head_hash, time, self.key_id)
        signature = self._private.sign(message).hex()
        return Checkpoint(size, root, head_hash, time, self.key_id, signature)

    def signature(self, message: bytes) -> str:
        """This key's signature of ``message``, in hex: for the statements besides a
        checkpoint the key vouches for (a proof's stream range, ledger.audit.proofs)."""
        return self._private.sign(message).hex()

    def public_pem(self) -> bytes:
        return self.public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def private_pem(self) -> bytes:
        return self._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def generate_key() -> SigningKey:
    return SigningKey(Ed25519PrivateKey.generate())


def load_signing_key(pem: bytes) -> SigningKey:
    """An unencrypted PKCS #8 PEM Ed25519 private key; KeyFileError otherwise."""
    try:
        private = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        raise KeyFileError("not an unencrypted PEM private key") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise KeyFileError("not an Ed25519 private key")
    return SigningKey(private)


def load_public_key(pem: bytes) -> Ed25519PublicKey:
    """A PEM (SubjectPublicKeyInfo) Ed25519 public key; KeyFileError otherwise."""
    try:
        public = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError):
        raise KeyFileError("not a PEM public key") from None
    if not isinstance(public, Ed25519PublicKey):
        raise KeyFileError("not an Ed25519 public key")
    return public


class PublicKeys:
    """The keys a verifier trusts, by key id (several: keys rotate)."""

    def __init__(self, keys: Iterable[Ed25519PublicKey]) -> None:
        self._keys: Mapping[str, Ed25519PublicKey] = {key_id_of(k): k for k in keys}

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def problem(self, checkpoint: Checkpoint) -> str | None:
        """Why the checkpoint's signature does not hold, or None if it does."""
        return self.signature_problem(checkpoint.key_id, checkpoint.message(), checkpoint.signature)

    def signature_problem(self, key_id: str, message: bytes, signature: str) -> str | None:
        """Why ``signature`` (hex) is not key ``key_id``'s of ``message``, or None if it is."""
        key = self._keys.get(key_id)
        if key is None:
            return f"signed by key {key_id}, which is not one of the public keys given"
        try:
            key.verify(bytes.fromhex(signature), message)
        except (InvalidSignature, ValueError):
            return f"its signature does not verify with key {key_id}"
        return None
