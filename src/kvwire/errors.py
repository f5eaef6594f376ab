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
    │   └── ModelMismatchError       the packet was made by another model (spec or fingerprint)
    ├── ChainError               a chain of delta packets is broken (missing parent, gap,
    │                            foreign link, token ids that do not match the context)
    ├── StoreError               a store cannot be opened or used
    │   ├── UnknownStoreError        no backend for that URL
    │   ├── VersionConflict          a compare-and-set put named a version the key is no longer at
    │   │   └── TurnTaken                another process already took this agent's turn
    │   └── OverBudget               one value is larger than the store's whole byte budget
    ├── UpstreamTimeout          the handoff an agent process waits for never appeared
    ├── CodecOptionsError        codec options are invalid (unknown encoding, short signing key,
    │                            a signature required but no key, a bad KVWIRE_* variable)
    ├── ModelError               a model cannot be found, converted, loaded or is unsupported
    ├── TranscriptError          a chat template cannot be extended turn by turn
    ├── TrainingError            training data or settings are invalid, or a saved adapter
    │                            does not fit the model it is loaded onto
    ├── QuestionSetError         a multiple-choice question set is malformed
    ├── PipelineConfigError      a pipeline file is malformed
    └── FuserError               cache-to-cache between different models (kvwire.fuse) cannot go on
        ├── FuserDataError           training data for a fuser is missing or malformed
        ├── CheckpointError          a projector/fuser checkpoint is missing, corrupt, or made for
        │                            another pair of models
        ├── AlignmentError           two tokenizers cannot be aligned (no character offsets, a text
        │                            one of them does not reproduce, message contents not found)
        └── NoFuserError             sharer and receiver differ and no projector/fuser is given for the pair

The CLI turns each into one ``error: ...`` line and a non-zero exit code.
"""

from __future__ import annotations


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


class ChainError(KvwireError):
    """A chain of delta packets cannot be assembled into one context."""


class StoreError(KvwireError):
    """A store cannot be opened, read or written."""


class UnknownStoreError(StoreError):
    """No store backend handles the given URL."""


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


class TranscriptError(KvwireError):
    """A chat transcript cannot be built incrementally from the model's chat template."""


class PipelineConfigError(KvwireError):
    """A pipeline description is malformed."""


class TrainingError(KvwireError):
    """Training data or settings are invalid, or a saved adapter does not fit the model it is loaded onto."""


class QuestionSetError(KvwireError):
    """A question set file is malformed (schema, duplicate ids, a key that cannot be checked)."""


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
