"""The heal's tensors, in stripes from every member that holds the source's state at once.

A receiver (a joiner, a member whose fingerprint differs: ``fingerprint.py``) needs every byte of the model's
parameters and buffers and of the optimizer's state. Sent from one member, that transfer is bounded by one sender's
bandwidth and grows with the model (the issue's figure: a join stopped the group 8.1 s at ~1.6 GB of state per
member). Here every tensor is cut into pieces of at most ``piece_bytes`` (a piece never spans two tensors), and the
pieces are dealt out to the ``S`` senders (every member whose fingerprint equals the source's) by bytes, so every
sender's link carries about ``1/S`` of the state, point to point. The idea is torchft's recovery from a live peer
and Gemini's (SOSP'23) restore from peers' memory in parallel; the code is this project's own.

No piece is copied on either side: a sender sends the bytes of its own tensor, a receiver receives straight into
its tensor's bytes (only a non-contiguous tensor goes through a contiguous copy of itself), with up to
:data:`WINDOW` pieces per sender in flight, so the transfer, the checks and the next pieces overlap and no member
ever holds a second copy of the state. Each piece is followed by a trailer: the checksum of its bytes (their sum as
int64, :func:`checksum`) and its number. A receiver checks every piece as it completes; after one that does not
verify it takes the remaining pieces (so that no sender waits on a receive that never comes) and fails the heal
(:class:`HealError`), which every member learns in the heal's last agreement. Its tensors then hold unchecked bytes:
such a member is never a source and never trains before a heal that succeeds (``heal.py``'s ``holds_state``).
(Before 2026-12, pieces went through a staging buffer and were checked before a byte was written: at ~100M
parameters that copy and its page faults were half of the heal's time, ``bench/heal.py``.)

The wire, per piece: its ``n`` bytes (tag ``PIECE_TAG + 2 * piece``), then two int64 (checksum, piece number; tag
``PIECE_TAG + 2 * piece + 1``). Every operation has the heal's bounded wait (``Link``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from elasticd.worker.hot.errors import HealAbandoned, HealError

TRAILER_BYTES = 16
# Tags of the heal's point-to-point messages: the description first, pieces after it (tag = PIECE_TAG + 2 * piece,
# its trailer's one more)
DESCRIPTION_TAG = 1
PIECE_TAG = 16
# Pieces in flight per sender (a receiver: per sender it receives from) before the oldest is waited for: enough to
# keep the link busy while a completed piece is checked, few enough to keep gloo's queue of operations short.
WINDOW = 4


class Link(Protocol):
    """The point-to-point operations of the heal's group, each waited for with the heal's timeout."""

    device: torch.device

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> object: ...

    def recv(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> object: ...

    def wait(self, work: object, what: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Piece:
    number: int
    tensor: int  # index of the tensor it lies in
    first: int  # its first byte in that tensor
    end: int

    @property
    def size(self) -> int:
        return self.end - self.first


@dataclass(frozen=True, slots=True)
class Layout:
    """Every piece of every tensor; the same on every member (same shapes and dtypes)."""

    sizes: tuple[int, ...]  # bytes of each tensor
    piece_bytes: int
    pieces: tuple[Piece, ...]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], piece_bytes: int) -> Layout:
        if piece_bytes <= 0 or piece_bytes % 8:
            # a piece starts 8-aligned in its tensor: its checksum reads the bytes as int64
            raise ValueError(f"piece_bytes must be a positive multiple of 8, not {piece_bytes}")
        sizes = tuple(t.numel() * t.element_size() for t in tensors)
        pieces: list[Piece] = []
        for index, size in enumerate(sizes):
            for first in range(0, size, piece_bytes):
                pieces.append(Piece(len(pieces), index, first, min(first + piece_bytes, size)))
        return cls(sizes, piece_bytes, tuple(pieces))

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def senders_of(self, senders: int) -> list[int]:
        """Which of ``senders`` senders (by index) sends each piece: each to the one with the fewest bytes so far."""
        loads = [0] * senders
        owners = []
        for piece in self.pieces:
            owner = loads.index(min(loads))
            owners.append(owner)
            loads[owner] += piece.size
        return owners


def send_stripes(
    link: Link,
    tensors: Sequence[torch.Tensor],
    layout: Layout,
    senders: Sequence[int],
    me: int,
    receivers: Sequence[int],
    before_piece: Callable[[int], None] | None = None,
) -> int:
    """Send this sender's pieces to every receiver. Bytes sent.

    A receiver whose operation fails (it died) gets nothing more; the others get every piece, so that none waits on
    a send that never comes, and then the first failure is raised. ``before_piece(piece)`` is called before each
    piece goes out (the fault injector's hook)."""
    raw = [_bytes_of(t) for t in tensors]
    owners = layout.senders_of(len(senders))
    mine = senders.index(me)
    in_flight: deque[tuple[list[tuple[int, object]], torch.Tensor, str]] = deque()
    gone: dict[int, HealError] = {}
    sent = 0

    def complete() -> None:
        works, _trailer, what = in_flight.popleft()  # the trailer lived until its sends completed
        for receiver, work in works:
            if receiver not in gone:
                _settle(link, work, what, receiver, gone)

    for piece in layout.pieces:
        if owners[piece.number] != mine:
            continue
        if before_piece is not None:
            before_piece(piece.number)
        data = raw[piece.tensor][piece.first : piece.end]
        trailer = _trailer(data, piece.number, link.device)
        what = f"sending piece {piece.number} of the state"
        works: list[tuple[int, object]] = []
        for receiver in receivers:
            for tensor, tag in ((data, PIECE_TAG + 2 * piece.number), (trailer, PIECE_TAG + 2 * piece.number + 1)):
                if receiver not in gone:
                    work = _issue(link.send, tensor, receiver, tag, what, gone)
                    if work is not None:
                        works.append((receiver, work))
        in_flight.append((works, trailer, what))
        sent += (piece.size + TRAILER_BYTES) * len(receivers)
        if len(in_flight) > WINDOW:
            complete()
    while in_flight:
        complete()
    if gone:
        raise next(iter(gone.values()))
    return sent


def receive_stripes(link: Link, tensors: Sequence[torch.Tensor], layout: Layout, senders: Sequence[int]) -> int:
    """Receive every piece from its sender straight into ``tensors`` and check it. Bytes received.

    After a sender's operation fails (it died) nothing more is asked of it; every other sender's pieces are still
    taken, so that none waits on a receive that never comes, and then the first failure is raised."""
    targets = [_writable(t) for t in tensors]
    raw = [target for target, _, _ in targets]
    owners = layout.senders_of(len(senders))
    in_flight: deque[tuple[Piece, int, list[object], torch.Tensor, str]] = deque()
    received = 0
    gone: dict[int, HealError] = {}
    bad: HealError | None = None  # the first piece that failed its check

    def complete() -> None:
        nonlocal bad
        piece, sender, works, trailer, what = in_flight.popleft()
        for work in works:
            if sender not in gone:
                _settle(link, work, what, sender, gone)
        if bad is None and sender not in gone:
            bad = _check(raw[piece.tensor][piece.first : piece.end], trailer, piece, sender)

    for piece in layout.pieces:
        sender = senders[owners[piece.number]]
        if sender in gone:
            continue
        what = f"receiving piece {piece.number} of the state from rank {sender}"
        data = raw[piece.tensor][piece.first : piece.end]
        trailer = torch.empty(2, dtype=torch.int64, device=link.device)
        works = []
        for tensor, tag in ((data, PIECE_TAG + 2 * piece.number), (trailer, PIECE_TAG + 2 * piece.number + 1)):
            work = _issue(link.recv, tensor, sender, tag, what, gone)
            if work is not None:
                works.append(work)
        in_flight.append((piece, sender, works, trailer, what))
        received += piece.size + TRAILER_BYTES
        if len(in_flight) > WINDOW * len(senders):
            complete()
    while in_flight:
        complete()
    if gone:
        raise next(iter(gone.values()))
    if bad is not None:  # raised once every piece is in: no sender is left waiting on a receive never posted
        raise bad
    with torch.no_grad():
        for _, staging, original in targets:
            if original is not None:
                original.copy_(staging)
    return received


def _issue(
    post: Callable[[torch.Tensor, int, int, str], object],
    tensor: torch.Tensor,
    peer: int,
    tag: int,
    what: str,
    gone: dict[int, HealError],
) -> object | None:
    """``post(tensor, peer, tag, what)`` (the link's send or recv); None when it failed at once (``peer`` is gone)."""
    try:
        return post(tensor, peer, tag, what)
    except HealAbandoned:
        raise
    except HealError as exc:
        gone.setdefault(peer, exc)
        return None


def _settle(link: Link, work: object, what: str, peer: int, gone: dict[int, HealError]) -> None:
    """Wait for ``work``; a failure marks ``peer`` as gone (a heal given up elsewhere ends the stripes at once)."""
    try:
        link.wait(work, what)
    except HealAbandoned:
        raise
    except HealError as exc:
        gone.setdefault(peer, exc)


def checksum(data: torch.Tensor) -> int:
    """The sum of ``data``'s bytes (a uint8 tensor) read as int64, the bytes past the last whole eight as themselves."""
    whole = data.numel() // 8 * 8
    try:
        head = data[:whole].view(torch.int64)
    except RuntimeError:  # a tensor whose storage does not start 8-aligned: read a copy
        head = data[:whole].clone().view(torch.int64)
    return int(head.sum().item()) + int(data[whole:].to(torch.int64).sum().item())


def _trailer(data: torch.Tensor, number: int, device: torch.device) -> torch.Tensor:
    """What follows a piece on the wire: its checksum and its number."""
    return torch.tensor([checksum(data), number], dtype=torch.int64, device=device)


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


def _check(data: torch.Tensor, trailer: torch.Tensor, piece: Piece, sender: int) -> HealError | None:
    expected, number = (int(v) for v in trailer.cpu().tolist())
    if number == piece.number and checksum(data) == expected:
        return None
    return HealError(f"piece {piece.number} of the state ({piece.size} bytes) failed its checksum", source=sender)
