"""The exceptions kvwire raises.

Every error kvwire raises on bad input is a :class:`KvwireError`; its message says
what went wrong, and ``hint`` (also appended to ``str(err)``) says what to do::

    KvwireError
    ├── PacketError              a packet is malformed or does not fit where it is used
    │   ├── CorruptPacketError       the bytes are not a valid kvwire packet
    │   │                            (truncated, bad header, bad tensor table, bad metadata)
    │   ├── ChecksumError            the content checksum does not match the bytes
    │   ├── SignatureError           a signing key is configured and the packet is unsigned,
    │   │                            signed with another key, or its signature does not verify
    │   ├── PacketTooLargeError      the packet, or the tensors it decodes to, exceed the size limit
    │   ├── ModelMismatchError       the packet was made by another model (spec or fingerprint)
    │   ├── NonFiniteError           the packet's keys or values hold NaN or Inf
    │   └── UnsupportedRopeError     kvwire cannot re-rotate this model's keys exactly (its RoPE,
    │                                measured on the model, matches no convention kvwire knows)
    ├── ChainError               a chain of delta packets is broken (missing parent, gap,
    │                            foreign link, token ids that do not match the context)
    ├── StoreError               a store cannot be opened or used (not retried, unless a StoreUnavailable)
    │   ├── StoreUnavailable         transient: the store may answer if asked again (connection refused or
    │   │                            reset, a timeout, a server still loading, a cluster failing over:
    │   │                            CLUSTERDOWN, TRYAGAIN, MOVED storms); agents retry these, and only these
    │   ├── StoreConfigError         permanent: the URL or the server's configuration is wrong (TLS
    │   │   │                        verification fails, no such database, a cluster URL for a single server,
    │   │   │                        the server out of memory); asking again cannot help
    │   │   ├── UnknownStoreError        no backend for that URL, or a parameter it does not take
    │   │   └── StoreAccessDenied        the credentials are refused (wrong or missing password) or the
    │   │                                user may not run a command on a key (an ACL's NOPERM)
    │   ├── VersionConflict          a compare-and-set put named a version the key is no longer at
    │   │   └── TurnTaken                another process already took this agent's turn
    │   └── OverBudget               one value is larger than the store's whole byte budget
    ├── UpstreamTimeout          the handoff an agent process waits for never appeared
    ├── CodecOptionsError        codec options are invalid (unknown encoding, short signing key,
    │                            a signature required but no key, a bad KVWIRE_* variable)
    ├── ModelError               a model cannot be found, converted, loaded or is unsupported
    ├── ContextTooLong           a context plus the tokens to generate reach past the model's window
    ├── EngineError              the batched-decode engine cannot take a request (it does not fit
    │                            the memory budget even alone, or the engine is busy)
    ├── TranscriptError          a chat template cannot be extended turn by turn
    ├── TrainingError            training data or settings are invalid, or a saved adapter
    │                            does not fit the model it is loaded onto
    ├── QuestionSetError         a multiple-choice question set is malformed
    ├── TaskSetError             a task set for ``kvwire eval`` is missing or malformed (or its
    │                            package is not installed), or a --shard / --limit is invalid
    ├── PipelineConfigError      a pipeline file is malformed
    ├── FuserError               cache-to-cache between different models (kvwire.fuse) cannot go on
    │   ├── FuserDataError           training data for a fuser is missing or malformed
    │   ├── CheckpointError          a projector/fuser checkpoint is missing, corrupt, or made for
    │   │                            another pair of models
    │   ├── AlignmentError           two tokenizers cannot be aligned (no character offsets, a text
    │   │                            one of them does not reproduce, message contents not found)
    │   ├── NoFuserError             sharer and receiver differ and no projector/fuser is given for the pair
    │   └── WorseThanAloneError      a projector whose validated gain over the receiver alone is not positive
    └── ServeError               ``kvwire serve`` refuses a request (each maps to one HTTP status,
        │                        in kvwire/serve/app.py alone)
        ├── InvalidRequest           malformed JSON, a field of the wrong type, roles out of order,
        │   │                        an unsupported option (400)
        │   └── ContextLengthExceeded    prompt, or prompt + max_tokens, longer than the model's context (400);
        │                                also a ContextTooLong
        ├── AuthenticationFailed     an API key is set and the request's is missing or wrong (401)
        ├── UnknownModel             the request names a model this server does not serve (404)
        ├── QueueFull                every batch slot and queue place is taken; retry later (429)
        └── ServerUnavailable        the server is shutting down or its model thread stopped (503)

The CLI turns each into one ``error: ...`` line and a non-zero exit code.
"""

from __future__ import annotations

from typing import Any


def reason(error: BaseException) -> str:
    """What went wrong, in words to put after a message that already names the path: an OSError's own
    text without Python's ``[Errno N] ...: 'PATH'`` wrapping ("Permission denied", "Is a directory"),
    text that is not UTF-8 as where it stops being so, anything else as it reads."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset {error.start})"
    return str(error)


class KvwireError(Exception):
    """Base class. ``hint`` tells the user what to do about it."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if not hint else f"{message} ({hint})")


class PacketError(KvwireError):
    """A packet is malformed, or does not fit the model or context it is used with."""


class CorruptPacketError(PacketError):
    """The bytes are not a valid kvwire packet."""


class ChecksumError(PacketError):
    """The content checksum recorded in a packet does not match its bytes."""


class SignatureError(PacketError):
    """A signing key is configured and the packet is unsigned, signed with another key, or altered."""


class PacketTooLargeError(PacketError):
    """A packet, or the tensors it decodes to, exceed the configured size limit."""


class ModelMismatchError(PacketError):
    """A packet was produced by a different model than the one asked to use it."""


class NonFiniteError(PacketError):
    """A packet's keys or values hold NaN or Inf: one such value poisons every later token."""


class UnsupportedRopeError(PacketError):
    """A model's RoPE, measured on the model itself, is not one kvwire can re-rotate exactly."""


class ChainError(KvwireError):
    """A chain of delta packets cannot be assembled into one context."""


class StoreError(KvwireError):
    """A store cannot be opened, read or written."""


class StoreUnavailable(StoreError):
    """A transient store fault: the same call may succeed if tried again later.

    Connection refused or reset, a timeout, a server still loading its data, a
    Redis Cluster failing over (CLUSTERDOWN, TRYAGAIN, a storm of MOVED replies).
    ``kvwire agent`` (:class:`kvwire.store.retrying.RetryingStore`) retries these and no
    other :class:`StoreError`; ``kvwire serve`` serves without reuse until they pass.
    """


class StoreConfigError(StoreError):
    """A permanent store fault: the URL or the server's configuration must change first.

    A TLS certificate that does not verify against the given CA, a database the
    server does not have, a cluster URL for a single server (or the reverse), a
    server out of memory or unable to persist. Never retried; the hint says what to fix.
    """


class UnknownStoreError(StoreConfigError):
    """No store backend handles the given URL, or the URL is malformed or takes no such parameter."""


class StoreAccessDenied(StoreConfigError):
    """The store refused the credentials (a wrong or missing password, an unknown user) or
    the user's ACL forbids a command or key (NOPERM). Never retried."""


class VersionConflict(StoreError):
    """A put with ``expect_version`` found the key at another version: a stale writer is rejected.

    ``key``, ``expected`` and ``actual`` (0 = the key is absent) say what was found.
    """

    def __init__(self, key: str, expected: int, actual: int) -> None:
        self.key, self.expected, self.actual = key, expected, actual
        state = "absent" if actual == 0 else f"at version {actual}"
        super().__init__(
            f"store key {key!r} is {state}, the writer expected version {expected}",
            "another writer got there first: read the key again with get_versioned(), rebuild, "
            "and put with the version you read",
        )


class OverBudget(StoreError):
    """A single value is larger than the store's whole byte budget; nothing was stored."""


class UpstreamTimeout(KvwireError):
    """The handoff an agent waits for did not appear in the store in time."""


class TurnTaken(VersionConflict):
    """Another process already took this agent's turn: its handoff is in the store."""

    def __init__(self, key: str, actual: int, store: str, agent: str, round: int, session: str) -> None:
        self.key, self.expected, self.actual = key, 0, actual
        KvwireError.__init__(
            self,
            f"agent {agent}'s turn in round {round} of session {session!r} is already taken: {key} is in "
            f"{store} at version {actual} (version conflict: this agent expected it absent)",
            "another process ran this agent for this round; start a new --session, or a later --round",
        )


class CodecOptionsError(KvwireError):
    """Codec options (encoding, signing key, size limit, or their environment variables) are invalid."""


class ModelError(KvwireError):
    """A model cannot be found, converted or loaded, or is not supported."""


class ContextTooLong(KvwireError):
    """A context plus the tokens to generate reach past the model's context window (``max_position_embeddings``).
    Raised by a pipeline, it names the agent and carries the turns ``finished`` before it (their replies)."""

    def __init__(self, message: str, hint: str | None = None, *, finished: tuple[Any, ...] = ()) -> None:
        super().__init__(message, hint)
        self.finished = finished


class EngineError(KvwireError):
    """The batched-decode engine (``kvwire.hf.engine``) cannot take a request."""


class TranscriptError(KvwireError):
    """A chat transcript cannot be built incrementally from the model's chat template."""


class PipelineConfigError(KvwireError):
    """A pipeline description is malformed."""


class TrainingError(KvwireError):
    """Training data or settings are invalid, or a saved adapter does not fit the model it is loaded onto."""


class QuestionSetError(KvwireError):
    """A question set file is malformed (schema, duplicate ids, a key that cannot be checked)."""


class TaskSetError(KvwireError):
    """A task set cannot be loaded (its file is missing, not UTF-8, or malformed: schema, duplicate ids, a regex
    that does not compile; or the package that holds a built-in set is not installed), or a selection of its tasks
    (``--shard``, ``--limit``) is invalid."""


class ServeError(KvwireError):
    """``kvwire serve`` refuses a request. ``param`` names the offending field (OpenAI's error object has it)."""

    def __init__(self, message: str, hint: str | None = None, *, param: str | None = None) -> None:
        super().__init__(message, hint)
        self.param = param


class InvalidRequest(ServeError):
    """A request is malformed: bad JSON, a field of the wrong type, roles out of order, an unsupported option."""


class ContextLengthExceeded(InvalidRequest, ContextTooLong):
    """The prompt, or the prompt plus the tokens asked for, exceed the model's context: the server's
    :class:`ContextTooLong` (one condition, one class to catch), answered with HTTP 400 as OpenAI does."""


class RequestTooLarge(InvalidRequest):
    """A request body over the server's byte limit (``--max-request-bytes``), refused before it is parsed:
    answered with HTTP 413."""


class AuthenticationFailed(ServeError):
    """The server has an API key and the request's is missing or different."""


class UnknownModel(ServeError):
    """The request names a model this server does not serve."""


class QueueFull(ServeError):
    """Every batch slot and every queue place is taken. ``retry_after_s`` says when to try again."""

    def __init__(self, message: str, hint: str | None = None, *, retry_after_s: int = 1) -> None:
        super().__init__(message, hint)
        self.retry_after_s = retry_after_s


class ServerUnavailable(ServeError):
    """The server is shutting down, or its model thread has stopped. ``retry_after_s``, when set, is
    sent as ``Retry-After`` (a draining server: try again, elsewhere or later)."""

    def __init__(self, message: str, hint: str | None = None, *, retry_after_s: int | None = None) -> None:
        super().__init__(message, hint)
        self.retry_after_s = retry_after_s


class FuserError(KvwireError):
    """A fuser cannot be built, trained, saved or loaded as asked."""


class FuserDataError(FuserError):
    """Training data for a fuser is missing or malformed."""


class CheckpointError(FuserError):
    """A fuser checkpoint is missing, corrupt, or made for another pair of models."""


class AlignmentError(FuserError):
    """Two tokenizers cannot be aligned character by character for this text."""


class NoFuserError(FuserError):
    """Sharer and receiver run different models and no projector or fuser is given for the pair."""


class WorseThanAloneError(FuserError):
    """A projector's recorded gain over the receiver alone is not positive (or none is recorded)."""
