"""yeto's wire protocol over ZeroMQ (ROUTER syncer, DEALER learners).

A message is a multipart ZeroMQ message: frame 0 is a UTF-8 JSON header
`{"v": PROTOCOL_VERSION, "type": ..., ...}`; frames 1..n are raw tensor
payloads, one per layout fragment, encoded by `yeto.sync.quant` (never pickle).
Every header field is checked against `SCHEMA` before a handler sees it, so a
malformed message becomes a `ProtocolError`, never a crash. docs/PROTOCOL.md
describes each message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from yeto.sync.layout import Layout
from yeto.sync.quant import BITS, ErrorFeedback, QuantError, dequantize, encoded_size, quantize

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 256 << 20  # enforced by ZMQ_MAXMSGSIZE on the syncer's socket and here
MAX_HEADER_BYTES = 4 << 20

# type -> {field: python type}; every listed field is required.
SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    # learner -> syncer
    "hello": {"learner": int, "backend": str, "layout": dict, "adapter_config": dict, "version": int, "fragments": list},
    "delta": {"learner": int, "round": int, "base_version": int, "tokens": int, "loss_tokens": int,
              "inner_steps": int, "loss": (int, float), "fragments": list},
    "ping": {"learner": int},
    "leave": {"learner": int, "reason": str},
    "sync": {"learner": int},
    # syncer -> learner
    "welcome": {"version": int, "round": int, "policy": dict, "fragments": list},
    "refuse": {"reason": str},
    "error": {"reason": str},
    "ack": {"round": int},
    "round": {"round": int, "version": int, "inner_steps": int, "round_seconds": (int, float)},
    "broadcast": {"version": int, "round": int, "responders": list, "weights": list, "fragments": list},
    "state": {"version": int, "round": int, "fragments": list},
    "pong": {"version": int, "round": int},
    "finish": {"version": int, "reason": str},
}


class ProtocolError(ValueError):
    pass


@dataclass
class Message:
    type: str
    header: dict[str, Any]
    frames: list[bytes] = field(default_factory=list)
    nbytes: int = 0  # size on the wire, all frames


def encode(msg_type: str, header: dict[str, Any] | None = None, frames: Sequence[bytes] = ()) -> list[bytes]:
    if msg_type not in SCHEMA:
        raise ProtocolError(f"unknown message type {msg_type!r}")
    head = json.dumps({"v": PROTOCOL_VERSION, "type": msg_type, **(header or {})}, separators=(",", ":")).encode()
    return [head, *frames]


def decode(parts: Sequence[bytes | memoryview]) -> Message:
    """Parse and validate one message; any defect is a ProtocolError naming it."""
    if not parts:
        raise ProtocolError("empty message")
    total = sum(len(p) for p in parts)
    if total > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {total} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    if len(parts[0]) > MAX_HEADER_BYTES:
        raise ProtocolError("header frame too large")
    try:
        header = json.loads(bytes(parts[0]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"header is not UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r} not supported (this side speaks {PROTOCOL_VERSION})")
    msg_type = header.get("type")
    if msg_type not in SCHEMA:
        raise ProtocolError(f"unknown message type {msg_type!r}")
    for name, typ in SCHEMA[msg_type].items():
        if name not in header:
            raise ProtocolError(f"{msg_type}: missing field {name!r}")
        value = header[name]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ProtocolError(f"{msg_type}: field {name!r} has type {type(value).__name__}")
    return Message(msg_type, header, [bytes(p) for p in parts[1:]], total)


# ----------------------------------------------------------------------------- tensor payloads


def fragment_descs(layout: Layout, bits: int) -> list[dict[str, int]]:
    return [{"index": f.index, "numel": f.numel, "bits": bits} for f in layout.fragments]


def encode_fragments(layout: Layout, flat: np.ndarray, bits: int) -> tuple[list[dict[str, int]], list[bytes]]:
    """(fragment descriptors for the header, payload frames) of a whole flat adapter vector."""
    return fragment_descs(layout, bits), [quantize(flat[f.start : f.start + f.numel], bits) for f in layout.fragments]


def encode_fragments_ef(layout: Layout, flat: np.ndarray, bits: int, ef: ErrorFeedback) -> tuple[list[dict[str, int]], list[bytes], np.ndarray]:
    """As `encode_fragments`, with error feedback; also returns what the receiver will decode."""
    frames, sent = ef.encode(flat, bits, [(f.start, f.numel) for f in layout.fragments])
    return fragment_descs(layout, bits), frames, sent


def decode_fragments(layout: Layout, msg: Message) -> np.ndarray:
    """The flat fp32 vector carried by a message, checked against the layout."""
    descs = msg.header["fragments"]
    if len(descs) != len(layout.fragments) or len(msg.frames) != len(layout.fragments):
        raise ProtocolError(f"{msg.type}: expected {len(layout.fragments)} fragments, got {len(descs)} descriptors "
                            f"and {len(msg.frames)} payload frames")
    out = np.empty(layout.numel, dtype=np.float32)
    for f, desc, frame in zip(layout.fragments, descs, msg.frames):
        if not isinstance(desc, dict) or desc.get("index") != f.index or desc.get("numel") != f.numel:
            raise ProtocolError(f"{msg.type}: fragment descriptor {desc!r} does not match layout fragment {f.index} ({f.numel} values)")
        bits = desc.get("bits")
        if bits not in BITS:
            raise ProtocolError(f"{msg.type}: fragment {f.index} has unsupported bits {bits!r}")
        if len(frame) != encoded_size(f.numel, bits):
            raise ProtocolError(f"{msg.type}: fragment {f.index} payload is {len(frame)} bytes, "
                                f"{bits}-bit encoding of {f.numel} values is {encoded_size(f.numel, bits)}")
        try:
            out[f.start : f.start + f.numel] = dequantize(frame, f.numel, bits)
        except QuantError as e:
            raise ProtocolError(f"{msg.type}: fragment {f.index}: {e}") from e
    return out


def message_bytes(parts: Sequence[bytes]) -> int:
    return sum(len(p) for p in parts)
