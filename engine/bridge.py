"""The bridge between host and device: every transfer of the engine and its kernels goes through here.

On a confidential-computing GPU the GPU runs at native speed; what costs is the bridge. Every copy
between the confidential VM and the GPU passes an encrypted bounce buffer: copies are serialized,
`non_blocking` copies block the calling thread at the runtime boundary, and each crossing pays a fixed
toll (~0.3 ms) whatever its size. So the engine crosses once each way per step:

- Host to device: a step's metadata (inputs, sampling settings, block ids to zero or check) is written
  into one persistent staging buffer (pinned on CUDA) as named segments (`Upload.add`), sent in one copy
  (`Bridge.send`) into one persistent device buffer, and read there as views, one per segment.
- Device to host: what a step reads back (picks, logprobs, residue counts) is packed on the device
  into one persistent buffer as named segments (`Bridge.fetch`), copied in one go, and turned into
  host values by a worker thread (`drain_on_worker`), so the scheduling thread never waits at the
  runtime boundary for it; it waits only when it reads the values (`Download.values`).

Other code adds its own data to a step's crossings without a crossing of its own: given the step's
`Upload`, it adds a segment (`upload.add("my_mask", values, torch.bool)`) and, after the send, reads
its device view (`views["my_mask"]`); given the step's `DownloadPlan`, it adds a device tensor
(`plan.add("my_counts", tensor)`) and finds its host values under the same name in `Download.values()`.
A segment name is used once per crossing. State that lasts across steps (per-slot settings, counters)
belongs in device tensors of its owner, updated from a segment carrying the diff, not re-sent whole.

Everything a step's crossings carry is request data (token ids, positions, picks, logprobs, embeddings),
and later steps, which may write fewer bytes, would leave it there for good; so the bridge zeroes every
byte of a crossing once it has been consumed. An upload: in its pinned buffer once its copy has landed
(checked at each send; waited for when the buffer is reused or the engine goes idle), in the device
buffer at the next send (past what that send overwrites) or when the engine goes idle (`Bridge.scrub`),
queued after every step that reads it. A download: in the device buffer by a memset queued after its copy,
in its pinned slot once its values are listed (one its step dropped unread is listed by `Bridge.scrub`: at
once if drained inline, once no step is in flight if the worker drains it). Buffers start zeroed and zero
the buffer they outgrow.
A reader that keeps nothing of a segment takes its values out of the download (`Download.take`). Only
weights (`Bridge.load`), no request's data, skip all this and pay nothing for it.

A view of the device buffer is valid until the next send: the next step's upload overwrites it (on
CUDA, ordered after every kernel already queued on the stream, so queued work reads what it was given).
Keep a copy (on the device) of anything needed longer.

Counting: every crossing is counted with its bytes (`CrossingCount`), in total and per step, whatever
the device: on a CPU the copies cost nothing, but the count is what a CUDA run makes. A simulated toll
(`toll_us`) makes every crossing wait that long, serialized across threads by one lock, to model a
bounce buffer on any device (benchmarks and tests; 0 in production).
"""

from __future__ import annotations

import math
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from engine.errors import EngineError

_ALIGN = 8  # every segment starts at a multiple of the widest element, so its bytes view as its dtype
_INITIAL_BYTES = 64 << 10
_MAX_VIEWS = 256  # views a staging buffer keeps for reuse
LOAD_CHUNK_BYTES = 256 << 20  # weights cross in pinned chunks of this size: few crossings for gigabytes

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
          torch.float64: np.float64, torch.bool: np.bool_, torch.uint8: np.uint8}
# The same dtypes as `struct` codes (native sizes, as the staging buffer's bytes are read on this host).
_STRUCT = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d", torch.bool: "?",
           torch.uint8: "B"}


@dataclass(slots=True)
class CrossingCount:
    """Crossings each way and the bytes they carried."""

    h2d: int = 0
    d2h: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0

    def add(self, other: CrossingCount) -> None:
        self.h2d += other.h2d
        self.d2h += other.d2h
        self.h2d_bytes += other.h2d_bytes
        self.d2h_bytes += other.d2h_bytes

    def copy(self) -> CrossingCount:
        return CrossingCount(self.h2d, self.d2h, self.h2d_bytes, self.d2h_bytes)


@dataclass(frozen=True, slots=True)
class BridgeStats:
    """What the engine reports of its crossings: the latest finished step's, and every one since it started."""

    steps: int
    last_step: CrossingCount
    total: CrossingCount


class Segment(NamedTuple):
    """Where a named segment lies in a crossing's buffer. A tuple: made, hashed and compared in C, as a
    step makes a dozen and looks each up among the views its buffer keeps."""

    offset: int  # bytes into the buffer
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Toll:
    """The simulated bounce buffer: each crossing holds one lock for `toll_us`, so crossings serialize."""

    def __init__(self, toll_us: float) -> None:
        if not toll_us >= 0:
            raise EngineError("bridge_toll_us must be a number >= 0")
        self.seconds = toll_us / 1e6
        self._lock = threading.Lock()

    def pay(self) -> None:
        if self.seconds:
            with self._lock:
                time.sleep(self.seconds)


class Staging:
    """A byte buffer that grows when a crossing needs more (rarely: it keeps its largest size), pinned on CUDA.

    It knows how far it holds a crossing's bytes (`held`), so that `scrub` zeroes those and no more. A
    scrubbed buffer (every one a step crosses through) is allocated zeroed and zeroes the buffer it
    outgrows before letting it go; `scrubbed=False` is for data of no request (weights), which pays nothing.
    """

    def __init__(self, device: torch.device, pinned: bool, scrubbed: bool = True) -> None:
        self.device = device
        self.pinned = pinned
        self.scrubbed = scrubbed
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.capacity = 0  # the tensor's bytes, kept as an int: reserve runs several times a step
        self.held = 0  # bytes from the start that may hold a crossing's data: zero past them
        self.array = self.tensor.numpy() if device.type == "cpu" else None
        # Views made before, by segment: a steady step lays out the same segments each time, and making a
        # view is three tensor ops. A view reads whatever the buffer holds now, so it never goes stale.
        self._views: dict[Segment, torch.Tensor] = {}
        self._flat_views: dict[Segment, torch.Tensor] = {}  # the same, one-dimensional (what a drain lists)

    def reserve(self, nbytes: int) -> None:
        """Room for `nbytes`; what the buffer holds is kept (an upload's earlier segments are already in it)."""
        if nbytes <= self.capacity:
            return
        size = max(_INITIAL_BYTES, 1 << (nbytes - 1).bit_length())
        allocate = torch.zeros if self.scrubbed else torch.empty  # no stale allocator bytes in a crossing
        grown = allocate(size, dtype=torch.uint8, device=self.device, pin_memory=self.pinned)
        grown[: self.capacity].copy_(self.tensor)
        if self.scrubbed and self.capacity:  # the allocator would hand the outgrown buffer's bytes out again
            _zero(self.tensor, self.array, 0, self.capacity)
        self.tensor, self.capacity = grown, size
        self.array = self.tensor.numpy() if self.device.type == "cpu" else None
        self._views, self._flat_views = {}, {}  # of the old buffer

    def hold(self, end: int) -> None:
        """Notes that the bytes up to `end` hold a crossing's data."""
        self.held = max(self.held, end)

    def scrub(self, keep: int = 0) -> None:
        """Zeroes the bytes held past `keep` (on a device: queued on the stream, after what reads them)."""
        if self.held > keep:
            _zero(self.tensor, self.array, keep, self.held)
            self.held = keep

    def view(self, segment: Segment) -> torch.Tensor:
        view = self._views.get(segment)
        if view is None:
            view = _kept(self._views, segment, self.flat(segment).view(segment.shape))
        return view

    def flat(self, segment: Segment) -> torch.Tensor:
        """The segment's values in one dimension, whatever its shape."""
        view = self._flat_views.get(segment)
        if view is None:
            raw = self.tensor[segment.offset : segment.offset + segment.nbytes]
            view = _kept(self._flat_views, segment, raw.view(segment.dtype))
        return view


def _zero(tensor: torch.Tensor, array: np.ndarray | None, start: int, end: int) -> None:
    if array is not None:  # host memory, through numpy: a drain's worker thread is outside inference mode
        array[start:end] = 0
        return
    # The guard `torch.inference_mode` enters, entered directly (as `ModelRunner.run` does): the bridge's
    # device buffers are inference tensors, and the idle scrub may run outside inference mode.
    with torch._C._InferenceMode(True):
        tensor[start:end].zero_()


def _kept(views: dict[Segment, torch.Tensor], segment: Segment, view: torch.Tensor) -> torch.Tensor:
    if len(views) >= _MAX_VIEWS:  # layouts that vary (diffs, prefills) would pile up
        views.clear()
    views[segment] = view
    return view


class Upload:
    """One host-to-device crossing being packed: named segments written into the staging buffer."""

    def __init__(self, staging: Staging) -> None:
        self._staging = staging
        self.segments: dict[str, Segment] = {}
        self.nbytes = 0

    def add(self, name: str, values: Sequence[int] | Sequence[float] | torch.Tensor, dtype: torch.dtype,
            shape: tuple[int, ...] | None = None) -> None:
        """Packs host values (a list, or a host tensor) as `dtype`, viewed on the device with `shape`."""
        if name in self.segments:
            raise EngineError(f"the step's upload already has a segment {name!r}")
        count = values.numel() if isinstance(values, torch.Tensor) else len(values)
        shape = (count,) if shape is None else shape
        if math.prod(shape) != count:
            raise EngineError(f"segment {name!r} holds {count} values, not the {shape} it is to be viewed as")
        segment = Segment(_aligned(self.nbytes), dtype, shape)
        end = segment.offset + count * dtype.itemsize
        self._staging.reserve(end)
        self._staging.hold(end)
        if count:
            self._write(segment, end, values)
        self.segments[name] = segment
        self.nbytes = end

    def _write(self, segment: Segment, end: int, values: Sequence | torch.Tensor) -> None:
        if isinstance(values, torch.Tensor):
            self._staging.view(segment).copy_(values.reshape(segment.shape))
            return
        try:
            # `struct` writes a list of Python numbers about three times faster than numpy's assignment.
            struct.pack_into(f"{len(values)}{_STRUCT[segment.dtype]}", self._staging.array, segment.offset, *values)
        except (struct.error, OverflowError, TypeError):
            # What struct refuses (a float past float32's range, say): numpy's conversion, exactly as before.
            self._staging.array[segment.offset : end].view(_NUMPY[segment.dtype])[:] = values

    def __contains__(self, name: str) -> bool:
        return name in self.segments


class DownloadPlan:
    """One device-to-host crossing being planned: named device tensors, packed when it is fetched."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Adds `tensor` as segment `name`; its bytes are zeroed in the bridge's buffers once read."""
        if name in self.tensors:
            raise EngineError(f"the step's download already has a segment {name!r}")
        if tensor.dtype not in _NUMPY:
            raise EngineError(f"segment {name!r} has dtype {tensor.dtype}, which the bridge does not carry")
        self.tensors[name] = tensor


@dataclass(slots=True)
class Download:
    """A device-to-host crossing on its way: host values by segment name once `values()` returns."""

    _future: Future | None
    _drain: Callable[[], dict[str, list]] | None
    _values: dict[str, list] | None = None

    def values(self) -> dict[str, list]:
        """Waits (if it must) for the copy and returns each segment's values as a flat host list."""
        if self._values is None:
            self._values = self._future.result() if self._future is not None else self._drain()
            self._future = self._drain = None
        return self._values

    def take(self, name: str) -> list:
        """A segment's values, removed from the download: the taker holds the only reference to them."""
        return self.values().pop(name)

    @property
    def is_read(self) -> bool:
        return self._values is not None

    @property
    def drains_inline(self) -> bool:
        """Not read yet, and drained by the reader's own thread (no worker holds it)."""
        return self._future is None and self._drain is not None


@dataclass(slots=True)
class _Slot:
    """One pinned host buffer for downloads and the event that says its last copy has landed."""

    staging: Staging
    done: torch.cuda.Event | None = None
    reader: Download | None = None  # the download whose values it holds until they are read


@dataclass(slots=True)
class _Uploads:
    """Staging buffers used in turn, so a step packs while the previous step's copy may still be queued."""

    staging: list[Staging]
    done: list[torch.cuda.Event | None] = field(default_factory=list)
    turn: int = 0


class Bridge:
    """Counts, tolls and performs every host<->device transfer; one per engine (per model runner)."""

    def __init__(self, device: torch.device, toll_us: float = 0.0, drain_on_worker: bool = False) -> None:
        self.device = device
        self.toll = Toll(toll_us)
        self.drain_on_worker = drain_on_worker
        cuda = device.type == "cuda"
        self.total = CrossingCount()
        self.step = CrossingCount()  # since `begin_step`
        self.last_step = CrossingCount()  # the previous step's, once `begin_step` starts the next
        self.steps = 0
        # Three staging buffers in turn, for the same reason as the download slots below.
        self._uploads = _Uploads([Staging(torch.device("cpu"), cuda) for _ in range(3)], [None] * 3)
        self._device_in = Staging(device, False)
        self._device_out = Staging(device, False)
        # Three: a step in flight, the step being launched, and a query read in between never wait on each other.
        self._slots = [_Slot(Staging(torch.device("cpu"), cuda)) for _ in range(3)]
        self._next_slot = 0
        self._worker: ThreadPoolExecutor | None = None
        self._upload: Upload | None = None

    # ----- steps ------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Starts a new step's count; what the previous step crossed stays in `last_step`."""
        if self.steps:
            self.last_step = self.step.copy()
        self.step = CrossingCount()
        self.steps += 1

    def stats(self) -> BridgeStats:
        return BridgeStats(self.steps, self.last_step.copy(), self.total.copy())

    # ----- host to device ---------------------------------------------------------------------

    def upload(self) -> Upload:
        """A new upload, packed into the staging buffer whose previous copy has surely landed."""
        turn = self._uploads.turn
        self._scrub_landed([turn], wait=True)  # a step ago: long landed, the wait returns at once
        self._upload = Upload(self._uploads.staging[turn])
        return self._upload

    def send(self, upload: Upload) -> dict[str, torch.Tensor]:
        """The one host-to-device crossing of `upload`: its segments as device views."""
        if upload is not self._upload:
            raise EngineError("only the latest upload can be sent; pack each crossing from Bridge.upload()")
        self._upload = None
        if not upload.segments:
            return {}
        turn = self._uploads.turn
        self._device_in.reserve(upload.nbytes)
        self._device_in.scrub(keep=upload.nbytes)  # the previous step's bytes past what this copy overwrites
        host = self._uploads.staging[turn].tensor[: upload.nbytes]
        self.toll.pay()
        self._device_in.tensor[: upload.nbytes].copy_(host, non_blocking=True)
        self._device_in.hold(upload.nbytes)
        self._uploads.done[turn] = _recorded_event(self.device)
        self._uploads.turn = (turn + 1) % len(self._uploads.staging)
        self._scrub_landed(range(len(self._uploads.staging)), wait=False)  # this one at once on a CPU
        self._count(CrossingCount(h2d=1, h2d_bytes=upload.nbytes))
        return {name: self._device_in.view(segment) for name, segment in upload.segments.items()}

    def _scrub_landed(self, turns: Iterable[int], wait: bool) -> None:
        """Zeroes the staging buffers of `turns` whose copy has landed (waiting for it if `wait`): what
        they held is on the device now."""
        for turn in turns:
            done = self._uploads.done[turn]
            if done is not None:
                if not wait and not done.query():
                    continue  # still crossing: zeroed by a later call
                done.synchronize()
                self._uploads.done[turn] = None
            self._uploads.staging[turn].scrub()

    def scrub(self, settled: bool = False) -> None:
        """Zeroes what the latest crossings left in the bridge and lets go of the downloads read already:
        the engine calls this whenever it has nothing to run. A download drained inline and never read (its
        step raised) is read now, which zeroes its slot. One the worker drains may belong to a step still in
        flight, which is not waited for, unless the caller says none is (`settled`: it holds no download it
        has yet to read): then every download not read was dropped, and is waited for and read now. Its
        drain zeroes its slot once its copy has landed (on CUDA, after the copy's event), never during the
        copy. Device bytes are zeroed already."""
        self._upload = None  # one packed and not sent would cross zeroed bytes: sending it fails instead
        self._scrub_landed(range(len(self._uploads.staging)), wait=True)
        self._device_in.scrub()  # on CUDA queued after every step already launched, which reads it
        for slot in self._slots:
            if slot.reader is not None and (settled or slot.reader.drains_inline):
                slot.reader.values()
            if slot.reader is not None and slot.reader.is_read:
                slot.reader = None

    # ----- device to host ---------------------------------------------------------------------

    def fetch(self, plan: DownloadPlan) -> Download:
        """The one device-to-host crossing of `plan`, started now; its values come from `Download.values()`."""
        segments, nbytes = _layout(plan.tensors)
        slot = self._take_slot()
        self._device_out.reserve(nbytes)
        slot.staging.reserve(nbytes)
        for name, tensor in plan.tensors.items():
            if tensor.numel():  # a segment has its tensor's own shape (`_layout`): copied as it is
                self._device_out.view(segments[name]).copy_(tensor)
        if nbytes:
            slot.staging.tensor[:nbytes].copy_(self._device_out.tensor[:nbytes], non_blocking=True)
        slot.done = _recorded_event(self.device)
        slot.staging.hold(nbytes)  # zeroed by the drain once listed
        self._device_out.hold(nbytes)
        self._device_out.scrub()  # queued after the copy on the same stream: zeroed once copied
        self._count(CrossingCount(d2h=1, d2h_bytes=nbytes))
        drain = _Drain(slot, segments, self.toll)
        download = Download(self._start(drain) if self.drain_on_worker else None, drain)
        slot.reader = download
        return download

    def read(self, plan: DownloadPlan) -> dict[str, list]:
        """A crossing read at once (queries, idle paths): what `fetch` starts, waited for."""
        return self.fetch(plan).values()

    def _take_slot(self) -> _Slot:
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._slots)
        reader, slot.reader = slot.reader, None
        if reader is not None:
            reader.values()  # read by now in every engine order; never let its values be overwritten unread
        return slot

    def _start(self, drain: _Drain) -> Future:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="veil-bridge-drain")
            weakref.finalize(self, self._worker.shutdown, wait=False)
        return self._worker.submit(drain)

    # ----- weights ----------------------------------------------------------------------------

    def load(self, tensors: Iterator[tuple[str, torch.Tensor]], chunk_bytes: int = LOAD_CHUNK_BYTES
             ) -> dict[str, torch.Tensor]:
        """Host tensors moved to the device in chunks of up to `chunk_bytes`: one crossing per chunk.

        Each chunk is packed into one pinned buffer, copied in one go, and cut into per-tensor device
        copies there. On a CPU nothing moves; the chunks are counted as CUDA would cross them.
        """
        loaded: dict[str, torch.Tensor] = {}
        chunk: list[tuple[str, torch.Tensor]] = []
        size = 0
        # One pinned buffer, reused; weights are no request's data: it is not scrubbed.
        staging = Staging(torch.device("cpu"), self.device.type == "cuda", scrubbed=False)
        for name, tensor in tensors:
            nbytes = _aligned(tensor.numel() * tensor.element_size())
            if chunk and size + nbytes > chunk_bytes:
                loaded |= self._load_chunk(chunk, size, staging)
                chunk, size = [], 0
            chunk.append((name, tensor))
            size += nbytes
        if chunk:
            loaded |= self._load_chunk(chunk, size, staging)
        return loaded

    def _load_chunk(self, chunk: list[tuple[str, torch.Tensor]], nbytes: int, staging: Staging
                    ) -> dict[str, torch.Tensor]:
        self.toll.pay()
        self._count(CrossingCount(h2d=1, h2d_bytes=nbytes))
        if self.device.type != "cuda":
            return dict(chunk)
        staging.reserve(nbytes)
        host = staging.tensor[:nbytes]
        offsets, offset = [], 0
        for _, tensor in chunk:
            flat = tensor.contiguous().view(-1).view(torch.uint8)
            host[offset : offset + flat.numel()].copy_(flat)
            offsets.append(offset)
            offset = _aligned(offset + flat.numel())
        device = host.to(self.device)  # waits for the copy: the staging buffer is refilled next
        return {name: _cut(device, start, tensor) for (name, tensor), start in zip(chunk, offsets)}

    # ----- counting ---------------------------------------------------------------------------

    def _count(self, crossing: CrossingCount) -> None:
        self.step.add(crossing)
        self.total.add(crossing)

    @contextmanager
    def counting(self) -> Iterator[CrossingCount]:
        """Counts the crossings made inside the block (tests and benchmarks)."""
        before = self.total.copy()
        counted = CrossingCount()
        try:
            yield counted
        finally:
            after = self.total
            counted.add(CrossingCount(after.h2d - before.h2d, after.d2h - before.d2h,
                                      after.h2d_bytes - before.h2d_bytes, after.d2h_bytes - before.d2h_bytes))


@dataclass(slots=True)
class _Drain:
    """Waits for a download's copy and turns its bytes into host lists: on the worker thread or inline."""

    slot: _Slot
    segments: dict[str, Segment]
    toll: Toll

    def __call__(self) -> dict[str, list]:
        if self.slot.done is not None:
            self.slot.done.synchronize()
        self.toll.pay()
        staging = self.slot.staging
        values = {name: staging.flat(segment).tolist() for name, segment in self.segments.items()}
        staging.scrub()  # listed: nothing of the download stays in the slot
        return values


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Segment], int]:
    segments: dict[str, Segment] = {}
    nbytes = 0
    for name, tensor in tensors.items():
        segment = Segment(_aligned(nbytes), tensor.dtype, tuple(tensor.shape))
        segments[name] = segment
        nbytes = segment.offset + segment.nbytes
    return segments, nbytes


def _cut(device_bytes: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A device tensor of its own holding like's bytes from device_bytes[offset:] (a copy on the device)."""
    nbytes = like.numel() * like.element_size()
    return device_bytes[offset : offset + nbytes].view(like.dtype).view(like.shape).clone()


def _recorded_event(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN
