"""yeto's wire protocol over ZeroMQ (ROUTER syncer, two DEALER connections per island).

A message is a multipart ZeroMQ message: frame 0 is a UTF-8 JSON header
`{"v": PROTOCOL_VERSION, "type": ..., ...}`; frames 1..n are raw tensor
payloads, one per layout fragment, encoded by `yeto.sync.wire.quant` (never pickle).
Every header field is checked against `SCHEMA` before a handler sees it, so a
malformed message becomes a `ProtocolError`, never a crash.

Each island keeps two connections to the syncer: *control* (join, heartbeats,
round announcements, acks: small and never queued behind a tensor) and *bulk*
(messages that carry an adapter). A multi-minute upload on the bulk connection
therefore never delays a heartbeat. docs/PROTOCOL.md describes each message.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Sequence

import numpy as np

from yeto.sync.wire.layout import Layout, fragment_pieces
from yeto.sync.wire.quant import BITS, ErrorFeedback, QuantError, dequantize, encoded_size, quantize

JOIN_PRINCIPAL = "join"  # the ZAP User-Id of a connection authenticated by the shared join key
ISLAND_PRINCIPAL = "island:"  # ... and of one authenticated by the key of one island id: "island:<id>"
PROTOCOL_VERSION = 7  # raised whenever SCHEMA changes: a peer of another version is refused, never misread
DEFAULT_MAX_MESSAGE_MB = 1024  # the syncer's default inbound limit (--max-message-mb)
MAX_HEADER_BYTES = 4 << 20  # a JSON header (a hello's config and provenance) larger than this is refused
HEADER_SLACK_BYTES = 64 << 10  # room for a delta's JSON header next to its payload when sizing a message
MAX_REASON_CHARS = 500  # error texts echoed to a peer or written to the tape are cut to this
# a gap this long between two timer ticks means the process was not running (suspended, a laptop asleep):
# its peers' silence over that gap is not held against them
CLOCK_JUMP_S = 2.0

_opt_list = (list, type(None))
_number = (int, float)

# type -> {field: python type}; every listed field is required (None allowed where the type says so).
SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    # island -> syncer (each also carries "island": int and "session": str)
    "hello": {"backend": str, "layout": dict, "adapter_config": dict, "version": int, "digest": str,
              "identity": str, "contract": dict},
    "init": {"fragments": list},
    "delta": {"round": int, "base_version": int, "tokens": int, "loss_tokens": int, "inner_steps": int,
              "loss": _number, "fragments": list},
    "ping": {"version": int, "pushed": _opt_list},
    "sync": {"version": int, "pushed": _opt_list},
    "leave": {"reason": str},
    # syncer -> island
    "welcome": {"incarnation": str, "version": int, "digest": str, "policy": dict, "open_round": (dict, type(None)),
                "contributed": bool, "merged": list, "finished": bool, "shard": list},
    "init_request": {"bits": int},
    "refuse": {"code": str, "reason": str},
    "error": {"code": str, "reason": str},
    "ack": {"round": int, "base_version": int, "digest": str, "duplicate": bool},
    "round": {"round": int, "version": int, "inner_steps": int, "round_seconds": _number},
    "broadcast": {"version": int, "round": int, "digest": str, "responders": list, "weights": list, "deltas": list,
                  "fragments": list},
    "state": {"version": int, "digest": str, "merged": list, "fragments": list},
    "pong": {"incarnation": str, "version": int, "round": int, "round_open": bool, "have_delta": bool,
             "contributed": bool, "finished": bool},
    "finish": {"version": int, "reason": str, "complete": bool},
}
ISLAND_TYPES = frozenset({"hello", "init", "delta", "ping", "sync", "leave"})
SYNCER_TYPES = frozenset(SCHEMA) - ISLAND_TYPES
BULK_TYPES = frozenset({"init", "delta", "state", "broadcast"})  # the messages that carry an adapter
BULK_SUFFIX = b"/bulk"  # an island's bulk connection has its control connection's routing id plus this


class Code(StrEnum):
    """Why a message was refused or answered with an error; islands branch on these, never on the text."""

    MALFORMED = "malformed"  # the message does not parse or fails its schema
    NOT_JOINED = "not_joined"  # say hello first (e.g. the syncer restarted, or dropped a silent island)
    SUPERSEDED = "superseded"  # a newer session of this island id joined; final for the old one
    LAYOUT = "layout_mismatch"  # the adapter's tensors differ from the run's; final
    TOO_LARGE = "too_large"  # this island's messages cannot fit --max-message-mb; final
    BAD_CONFIG = "bad_config"  # hello's adapter config or provenance is unusable; final
    STALE = "stale"  # a delta for a round that is not open, or against another base version
    REFUSED = "refused"  # a delta whose content was refused (counts, values, or its merge failed)
    DUPLICATE = "duplicate"  # this island already contributed a different delta to the round
    WRONG_PHASE = "wrong_phase"  # e.g. an initial adapter nobody asked for
    BUSY = "busy"  # this island id is held by a live, newer session: say hello again later
    ID_TAKEN = "id_taken"  # this island id is held by a live island with another identity: say hello again later
    IDENTITY = "identity"  # this connection's key may not speak for that island id; final
    CONTRACT = "contract_mismatch"  # base model, LoRA settings or layout differ from the run's; final
    REVOKED = "revoked"  # this island's key was revoked; final
    RATE_LIMITED = "rate_limited"  # too many requests of this kind: retry later
    INTERNAL = "internal"  # a syncer bug; recorded, the message had no effect


FINAL_CODES = frozenset({Code.SUPERSEDED, Code.LAYOUT, Code.TOO_LARGE, Code.BAD_CONFIG, Code.IDENTITY, Code.CONTRACT,
                         Code.REVOKED})
MAX_IDENTITY_CHARS = 128  # a hello's identity secret: at least 16 to be unguessable, at most this to stay small


class ProtocolError(ValueError):
    """A message that cannot be accepted; `code` says why in a form a program can branch on."""

    def __init__(self, reason: str, code: Code = Code.MALFORMED):
        super().__init__(reason)
        self.code = code


@dataclass
class Message:
    type: str
    header: dict[str, Any]
    frames: list[bytes] = field(default_factory=list)
    nbytes: int = 0  # size on the wire, all frames


def truncate(text: str, limit: int = MAX_REASON_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def encode(msg_type: str, header: dict[str, Any] | None = None, frames: Sequence[bytes] = ()) -> list[bytes]:
    if msg_type not in SCHEMA:
        raise ProtocolError(f"unknown message type {msg_type!r}")
    head = json.dumps({"v": PROTOCOL_VERSION, "type": msg_type, **(header or {})}, separators=(",", ":")).encode()
    return [head, *frames]


def decode(parts: Sequence[bytes | memoryview], max_bytes: int | None = None) -> Message:
    """Parse and validate one message; any defect is a ProtocolError naming it."""
    if not parts:
        raise ProtocolError("empty message")
    total = sum(len(p) for p in parts)
    if max_bytes is not None and total > max_bytes:
        raise ProtocolError(f"message of {total} bytes exceeds the {max_bytes}-byte limit (--max-message-mb)",
                            Code.TOO_LARGE)
    if len(parts[0]) > MAX_HEADER_BYTES:
        raise ProtocolError("header frame too large")
    try:
        header = json.loads(bytes(parts[0]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"header is not UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {truncate(repr(header.get('v')), 20)} not supported (this side speaks "
                            f"{PROTOCOL_VERSION}): run the same yeto version on the syncer and the islands")
    msg_type = header.get("type")
    if msg_type not in SCHEMA:
        raise ProtocolError(f"unknown message type {truncate(repr(msg_type), 80)}")
    fields = dict(SCHEMA[msg_type])
    if msg_type in ISLAND_TYPES:
        fields.update(island=int, session=str)
    for name, typ in fields.items():
        if name not in header:
            raise ProtocolError(f"{msg_type}: missing field {name!r}")
        value = header[name]
        if not isinstance(value, typ) or (isinstance(value, bool) and bool not in _as_tuple(typ)):
            raise ProtocolError(f"{msg_type}: field {name!r} has type {type(value).__name__}")
    return Message(msg_type, header, [bytes(p) for p in parts[1:]], total)


def _as_tuple(typ: type | tuple[type, ...]) -> tuple[type, ...]:
    return typ if isinstance(typ, tuple) else (typ,)


def is_bulk(msg_type: str) -> bool:
    return msg_type in BULK_TYPES


def session_id(started_at_us: int, rng: random.Random) -> str:
    """16 hex digits of start time, then 8 random: sessions of one island id compare by when they started."""
    return f"{started_at_us & (1 << 64) - 1:016x}{rng.getrandbits(32):08x}"


def session_start(session: str) -> int:
    """The start time a session id carries (0 if it carries none: it counts as the oldest)."""
    try:
        return int(session[:16], 16) if len(session) > 16 else 0
    except ValueError:
        return 0


def identity_proof(identity: str) -> str:
    """What the syncer keeps of an island's identity secret (sent inside the encrypted channel): its hash."""
    if not 16 <= len(identity) <= MAX_IDENTITY_CHARS:
        raise ProtocolError(f"hello: identity must be 16-{MAX_IDENTITY_CHARS} characters")
    return hashlib.sha256(identity.encode()).hexdigest()[:32]


# ----------------------------------------------------------------------------- digests


def digest_bytes(chunks: Sequence[bytes | memoryview]) -> str:
    """A short content hash (sha256, 16 hex digits): names a payload or a global adapter on the tape."""
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()[:16]


def array_digest(flat: np.ndarray) -> str:
    return digest_bytes([np.ascontiguousarray(flat, dtype=np.float32).tobytes()])


# ----------------------------------------------------------------------------- tensor payloads


def fragment_descs(layout: Layout, bits: int, indices: Sequence[int] | None = None) -> list[dict[str, int]]:
    frags = layout.fragments if indices is None else [layout.fragments[i] for i in indices]
    return [{"index": f.index, "numel": f.numel, "bits": bits} for f in frags]


def encode_fragments(layout: Layout, flat: np.ndarray, bits: int) -> tuple[list[dict[str, int]], list[bytes]]:
    """(fragment descriptors for the header, payload frames) of a whole flat adapter vector."""
    return fragment_descs(layout, bits), [quantize(flat[f.start : f.start + f.numel], bits) for f in layout.fragments]


def encode_fragments_ef(layout: Layout, flat: np.ndarray, bits: int, ef: ErrorFeedback,
                        only: Sequence[int] | None = None) -> tuple[list[dict[str, int]], list[bytes], np.ndarray]:
    """As `encode_fragments`, with error feedback; also returns what the receiver will decode. `only`: the
    fragments to send (a streamed part); the others are neither sent nor touch the residual."""
    indices = tuple(range(len(layout.fragments))) if only is None else tuple(only)
    frames, sent = ef.encode(flat, bits, fragment_pieces(layout, indices))
    return fragment_descs(layout, bits, indices), frames, sent


def message_size(layout: Layout, bits: int) -> int:
    """Upper bound of the bytes of a message carrying the whole adapter at `bits`."""
    return sum(encoded_size(f.numel, bits) for f in layout.fragments) + HEADER_SLACK_BYTES


def check_fragments(layout: Layout, msg: Message, part: Sequence[int] | None = None) -> list:
    """The layout fragments a message's payload frames carry, each checked (index, size, bits, payload length)
    without decoding it; `part` as for `decode_fragments`."""
    frags = layout.fragments if part is None else [layout.fragments[i] for i in part]
    descs = msg.header["fragments"]
    if len(descs) != len(frags) or len(msg.frames) != len(frags):
        raise ProtocolError(f"{msg.type}: expected {len(frags)} fragments, got {len(descs)} descriptors "
                            f"and {len(msg.frames)} payload frames")
    for f, desc, frame in zip(frags, descs, msg.frames):
        if not isinstance(desc, dict) or desc.get("index") != f.index or desc.get("numel") != f.numel:
            raise ProtocolError(f"{msg.type}: fragment descriptor {truncate(repr(desc), 120)} does not match layout "
                                f"fragment {f.index} ({f.numel} values)")
        bits = desc.get("bits")
        if bits not in BITS:
            raise ProtocolError(f"{msg.type}: fragment {f.index} has unsupported bits {truncate(repr(bits), 40)}")
        if len(frame) != encoded_size(f.numel, bits):
            raise ProtocolError(f"{msg.type}: fragment {f.index} payload is {len(frame)} bytes, "
                                f"{bits}-bit encoding of {f.numel} values is {encoded_size(f.numel, bits)}")
    return frags


def decode_fragments(layout: Layout, msg: Message, part: Sequence[int] | None = None) -> np.ndarray:
    """The flat fp32 vector carried by a message, checked against the layout. `part`: the fragments it must carry
    (a streamed round's; default all of them); the others decode as zero."""
    frags = check_fragments(layout, msg, part)
    out = np.empty(layout.numel, dtype=np.float32) if part is None else np.zeros(layout.numel, dtype=np.float32)
    for f, desc, frame in zip(frags, msg.header["fragments"], msg.frames):
        try:
            dequantize(frame, f.numel, desc["bits"], out=out[f.start : f.start + f.numel])
        except QuantError as e:
            raise ProtocolError(f"{msg.type}: fragment {f.index}: {e}", Code.REFUSED) from e
    return out


def message_bytes(parts: Sequence[bytes]) -> int:
    return sum(len(p) for p in parts)
