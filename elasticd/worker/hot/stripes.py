"""The heal's tensors, in stripes from every member that holds the source's state at once.

A receiver (a joiner, a member whose fingerprint differs: ``fingerprint.py``) needs every byte of the model's
parameters and buffers and of the optimizer's state. Sent from one member, that transfer is bounded by one sender's
bandwidth and grows with the model (the issue's figure: a join stopped the group 8.1 s at ~1.6 GB of state per
member). Here the bytes of all tensors, in their state-dict order, are one stream cut into pieces of at most
``piece_bytes``; piece ``k`` comes from sender ``k mod S`` (``S`` senders, every member whose fingerprint equals the
source's), point to point, so every sender's link carries ``1/S`` of the state, and a receiver takes one piece from
each sender at a time. The idea is torchft's recovery from a live peer and Gemini's (SOSP'23) restore from peers'
memory in parallel; the code is this project's own.

Memory stays bounded: a sender packs one piece at a time (sent to every receiver from the same buffer), a receiver
holds one buffer per sender; pieces are written into the tensors as they arrive, so no member ever holds a second
copy of the state. Each piece carries a trailer: the int64 sum of its bytes and its number. A receiver checks both
before it writes a byte of it; after a piece that does not verify it writes nothing more, takes the remaining pieces
(so that no sender waits on a receive that never comes) and fails the heal (:class:`HealError`), which every member
learns in the heal's last agreement: a half-healed receiver never trains.

The wire, per piece: ``n`` data bytes, zero padding to a multiple of 8, then two int64 (sum of the padded data as
int64, piece number). Every operation has the heal's bounded wait (``Link``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from elasticd.worker.hot.errors import HealError

TRAILER_BYTES = 16
# Tags of the heal's point-to-point messages: the description first, pieces after it (tag = PIECE_TAG + piece)
DESCRIPTION_TAG = 1
PIECE_TAG = 16


class Link(Protocol):
    """The point-to-point operations of the heal's group, each waited for with the heal's timeout."""

    device: torch.device

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> object: ...

    def recv(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> object: ...

    def wait(self, work: object, what: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Layout:
    """Where every piece of the stream lies in the tensors; the same on every member (same shapes and dtypes)."""

    sizes: tuple[int, ...]  # bytes of each tensor
    piece_bytes: int

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], piece_bytes: int) -> Layout:
        if piece_bytes <= 0 or piece_bytes % 8:
            raise ValueError(f"piece_bytes must be a positive multiple of 8, not {piece_bytes}")
        return cls(tuple(t.numel() * t.element_size() for t in tensors), piece_bytes)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def pieces(self) -> int:
        return -(-self.total // self.piece_bytes)

    def piece_size(self, piece: int) -> int:
        return min(self.piece_bytes, self.total - piece * self.piece_bytes)

    def spans(self, piece: int) -> Iterator[tuple[int, int, int, int]]:
        """(tensor, first byte, end byte, offset in the piece) of each tensor run the piece covers."""
        begin = piece * self.piece_bytes
        end = begin + self.piece_size(piece)
        start = 0
        for index, size in enumerate(self.sizes):
            stop = start + size
            if stop > begin and start < end:
                first, last = max(begin, start), min(end, stop)
                yield index, first - start, last - start, first - begin
            if stop >= end:
                return
            start = stop


def send_stripes(
    link: Link,
    tensors: Sequence[torch.Tensor],
    layout: Layout,
    senders: Sequence[int],
    me: int,
    receivers: Sequence[int],
    before_piece: Callable[[int], None] | None = None,
) -> int:
    """Send this sender's pieces (every ``len(senders)``-th, from its own index on) to every receiver. Bytes sent.

    ``before_piece(piece)`` is called before each piece goes out (the fault injector's hook)."""
    raw = [_bytes_of(t) for t in tensors]
    buffer = torch.empty(_wire_bytes(layout.piece_bytes), dtype=torch.uint8, device=link.device)
    sent = 0
    for piece in range(senders.index(me), layout.pieces, len(senders)):
        if before_piece is not None:
            before_piece(piece)
        wire = _pack(buffer, raw, layout, piece)
        what = f"sending piece {piece} of the state"
        works = [link.send(wire, receiver, PIECE_TAG + piece, what) for receiver in receivers]
        for work in works:
            link.wait(work, what)
        sent += wire.numel() * len(receivers)
    return sent


def receive_stripes(link: Link, tensors: Sequence[torch.Tensor], layout: Layout, senders: Sequence[int]) -> int:
    """Receive every piece from its sender, one piece from each sender at a time, check it and write it into
    ``tensors``. Bytes received."""
    targets = [_writable(t) for t in tensors]
    raw = [target for target, _, _ in targets]
    buffers = [torch.empty(_wire_bytes(layout.piece_bytes), dtype=torch.uint8, device=link.device) for _ in senders]
    received = 0
    bad: HealError | None = None  # the first piece that failed its check: nothing is written from then on
    for first in range(0, layout.pieces, len(senders)):
        pending = []
        for offset, sender in enumerate(senders):
            piece = first + offset
            if piece >= layout.pieces:
                break
            wire = buffers[offset][: _wire_bytes(layout.piece_size(piece))]
            what = f"receiving piece {piece} of the state from rank {sender}"
            pending.append((piece, sender, wire, link.recv(wire, sender, PIECE_TAG + piece, what), what))
        for piece, sender, wire, work, what in pending:
            link.wait(work, what)
            received += wire.numel()
            if bad is None:
                bad = _check(wire, layout.piece_size(piece), piece, sender)
            if bad is None:
                _unpack(wire, raw, layout, piece)
    if bad is not None:  # raised once every piece is in: no sender is left waiting on a receive never posted
        raise bad
    with torch.no_grad():
        for _, staging, original in targets:
            if original is not None:
                original.copy_(staging)
    return received


def _wire_bytes(size: int) -> int:
    return -(-size // 8) * 8 + TRAILER_BYTES


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def _writable(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The bytes to write into, the tensor they belong to, and the tensor to copy that to afterwards when the bytes
    are not its own storage (a non-contiguous tensor is received into a contiguous copy)."""
    flat = tensor.detach()
    if flat.is_contiguous():
        return flat.reshape(-1).view(torch.uint8), flat, None
    staging = flat.contiguous()
    return staging.reshape(-1).view(torch.uint8), staging, tensor


def _pack(buffer: torch.Tensor, raw: Sequence[torch.Tensor], layout: Layout, piece: int) -> torch.Tensor:
    """Piece ``piece``'s bytes, padding and trailer, in ``buffer``: what goes on the wire."""
    size = layout.piece_size(piece)
    padded = -(-size // 8) * 8
    wire = buffer[: padded + TRAILER_BYTES]
    for index, first, last, at in layout.spans(piece):
        wire[at : at + last - first].copy_(raw[index][first:last])
    wire[size:padded].zero_()
    trailer = wire[padded:].view(torch.int64)
    trailer[0] = wire[:padded].view(torch.int64).sum()
    trailer[1] = piece
    return wire


def _check(wire: torch.Tensor, size: int, piece: int, sender: int) -> HealError | None:
    padded = wire.numel() - TRAILER_BYTES
    checksum, number = (int(v) for v in wire[padded:].view(torch.int64).tolist())
    if number == piece and int(wire[:padded].view(torch.int64).sum().item()) == checksum:
        return None
    return HealError(f"piece {piece} of the state ({size} bytes) failed its checksum", source=sender)


def _unpack(wire: torch.Tensor, raw: Sequence[torch.Tensor], layout: Layout, piece: int) -> None:
    with torch.no_grad():
        for index, first, last, at in layout.spans(piece):
            raw[index][first:last].copy_(wire[at : at + last - first])
