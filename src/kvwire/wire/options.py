"""How packets are encoded and what decoding accepts: :class:`CodecOptions`, from arguments or the environment.

Agents are usually configured by their environment (``KVWIRE_ENCODING``,
``KVWIRE_SIGNING_KEY``, ``KVWIRE_REQUIRE_SIGNATURE``, ``KVWIRE_MAX_PACKET_BYTES``,
``KVWIRE_CHECK_FINITE``);
:mod:`kvwire.wire.codec` and :mod:`kvwire.kv.chain` read it when given ``options=None``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from . import signing
from ..errors import CodecOptionsError
from .quant import ENCODINGS, Encoding
from .signing import ENV_SIGNING_KEY, MIN_KEY_BYTES

MAX_PACKET_BYTES = 4 * 2**30  # default bound on a packet's bytes and on its decoded tensors

ENV_ENCODING = "KVWIRE_ENCODING"
ENV_REQUIRE_SIGNATURE = "KVWIRE_REQUIRE_SIGNATURE"
ENV_MAX_PACKET_BYTES = "KVWIRE_MAX_PACKET_BYTES"
ENV_CHECK_FINITE = "KVWIRE_CHECK_FINITE"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class CodecOptions:
    """How packets are encoded, and what decode accepts.

    ``CodecOptions()`` is the plain format: the spec's dtype, unsigned, no signature
    required. The functions of this module and of :mod:`kvwire.kv.chain` take
    ``options=None`` to mean :meth:`from_env` (so agents are configured by their
    environment); pass ``CodecOptions()`` to ignore the environment.
    """

    encoding: Encoding | None = None  # None: the spec's own dtype (lossless, zero-copy decode)
    key: bytes | str | None = field(default=None, repr=False)  # shared HMAC key: sign on encode, verify on decode
    require_signature: bool = False  # refuse to work without a key (guards against a missing variable)
    max_bytes: int = MAX_PACKET_BYTES  # bound on a packet's bytes and on the tensors it decodes to
    # refuse K/V holding NaN or Inf (one pass over the decoded tensors; see README for its cost).
    # Turn off only for a trusted sender: one such value poisons everything generated from the cache.
    check_finite: bool = True

    def __post_init__(self) -> None:
        if self.encoding is not None and self.encoding not in ENCODINGS:
            raise CodecOptionsError(f"unknown packet encoding {self.encoding!r}", f"use one of {', '.join(ENCODINGS)}")
        if isinstance(self.key, str):
            object.__setattr__(self, "key", self.key.encode())
        if self.key is not None:
            if not isinstance(self.key, bytes):
                raise CodecOptionsError(f"signing key must be bytes or str, got {type(self.key).__name__}")
            if len(self.key) < MIN_KEY_BYTES:
                raise CodecOptionsError(
                    f"signing key is {len(self.key)} bytes, at least {MIN_KEY_BYTES} are needed",
                    "generate one with: python -c 'import secrets; print(secrets.token_hex(32))'")
        if self.require_signature and self.key is None:
            raise CodecOptionsError(
                "a signature is required but no signing key is configured, so no packet could be verified",
                f"set {ENV_SIGNING_KEY} to the key every agent shares, or pass key=...")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes <= 0:
            raise CodecOptionsError(f"max_bytes must be a positive int, got {self.max_bytes!r}")
        for name in ("require_signature", "check_finite"):
            if not isinstance(getattr(self, name), bool):
                raise CodecOptionsError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CodecOptions:
        """Options from ``KVWIRE_SIGNING_KEY`` (the shared key, as UTF-8 text), ``KVWIRE_ENCODING``
        (one of ``fp32 fp16 bf16 int8 int4``), ``KVWIRE_REQUIRE_SIGNATURE`` (``1``/``0``),
        ``KVWIRE_MAX_PACKET_BYTES`` and ``KVWIRE_CHECK_FINITE`` (``1``/``0``; ``0`` skips the
        NaN/Inf scan for trusted senders); unset variables keep the defaults.

        Example: ``KVWIRE_SIGNING_KEY=3f9c...e1 KVWIRE_ENCODING=int8`` -> packets are
        int8 and signed, and unsigned packets are refused.
        """
        env = os.environ if environ is None else environ
        fields: dict[str, Any] = {}
        if ENV_SIGNING_KEY in env:
            fields["key"] = env[ENV_SIGNING_KEY]
        if ENV_ENCODING in env:
            fields["encoding"] = env[ENV_ENCODING].strip()
        for name, variable in (("require_signature", ENV_REQUIRE_SIGNATURE), ("check_finite", ENV_CHECK_FINITE)):
            if variable in env:
                value = env[variable].strip().lower()
                if value not in _TRUE + _FALSE:
                    raise CodecOptionsError(f"{variable}={value!r} is not a boolean", "use 1 or 0")
                fields[name] = value in _TRUE
        if ENV_MAX_PACKET_BYTES in env:
            try:
                fields["max_bytes"] = int(env[ENV_MAX_PACKET_BYTES])
            except ValueError:
                raise CodecOptionsError(f"{ENV_MAX_PACKET_BYTES}={env[ENV_MAX_PACKET_BYTES]!r} is not an integer",
                                        "give a number of bytes") from None
        # each variable alone first, so that a bad one is named (a signing key's value never is)
        for name, variable in (("encoding", ENV_ENCODING), ("key", ENV_SIGNING_KEY),
                               ("max_bytes", ENV_MAX_PACKET_BYTES)):
            if name in fields:
                try:
                    cls(**{name: fields[name]})
                except CodecOptionsError as error:
                    shown = variable if name == "key" else f"{variable}={env[variable]!r}"
                    raise CodecOptionsError(f"{shown} in the environment: {error.message}", error.hint) from None
        try:
            return cls(**fields)
        except CodecOptionsError as error:  # a combination: a signature required without a key
            raise CodecOptionsError(f"{ENV_REQUIRE_SIGNATURE}=1 in the environment: {error.message}",
                                    f"set {ENV_SIGNING_KEY} to the key every agent shares, or unset "
                                    f"{ENV_REQUIRE_SIGNATURE}") from None

    @property
    def key_bytes(self) -> bytes | None:
        """The signing key (a ``str`` key is stored UTF-8 encoded), or None."""
        return self.key if isinstance(self.key, bytes) else None

    @property
    def key_id(self) -> str | None:
        """16 hex digits naming the key (safe to show), or None without a key."""
        return signing.key_id(self.key_bytes) if self.key_bytes is not None else None


def options_or_env(options: CodecOptions | None, **given: Any) -> CodecOptions:
    """``options`` (or the environment's) with the explicitly given (non-None) fields replaced."""
    base = options if options is not None else CodecOptions.from_env()
    changes = {name: value for name, value in given.items() if value is not None}
    return replace(base, **changes) if changes else base
