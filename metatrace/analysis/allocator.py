"""PyTorch's CUDA caching allocator, simulated: from a sequence of mallocs and frees to the
memory it reserves from the device (pure, no torch).

The rules are those of c10/cuda/CUDACachingAllocator.cpp as torch 2.13 has them
(../shared/notes/device-memory.md, with the lines they come from):
- a request is rounded up to 512 bytes, or to the next of `roundup_power2_divisions` steps
  between two powers of two where that is set (`round_size`);
- requests up to 1 MiB come from the small pool, larger ones from the large pool; pools are
  per stream, and a cached block never serves another stream;
- a cached block is found best fit: the smallest one at least as large, the lowest address
  among equals (`get_free_block`); with `max_split_size_mb`, a request below it never takes a
  block at or above it, and a request at or above it never one `max_non_split_rounding_mb` or
  more larger;
- with no cached block, a segment is cudaMalloc'd: 2 MiB for the small pool, 20 MiB
  (`large_segment_size_mb`) for requests under 10 MiB, otherwise the request rounded up to
  2 MiB (`get_allocation_size`);
- the block found is split when the rest is at least 512 bytes (small pool, expandable
  segments) or, in the large pool, when the request is below `max_split_size` and the rest is
  over 1 MiB (`should_split`); a freed block merges with free neighbours of its segment;
- a block used on another stream (`record_stream`) returns to the cache only when that
  stream's work is done, which the allocator checks at its next malloc (`process_events`);
- with `expandable_segments`, each pool of a stream has one segment that grows by mapping
  pages (2 MiB small, 20 MiB large) at its end, and a request that fits nowhere maps just
  enough pages;
- when the device cannot hold another segment, every cached segment that holds nothing is
  freed (free pages unmapped with expandable segments) and the request tried again; then it
  is out of memory (`release_cached_blocks`, the OOM path).

Reserved memory (`max_memory_reserved()`) is the sum of the segments (mapped pages) at their
most; it never shrinks except on that retry.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

from metatrace.config.allocator import (
    INTERVALS,
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    AllocatorConfig,
)


def round_size(size: int, config: AllocatorConfig) -> int:
    """The bytes a request of `size` takes (round_size)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    log = size.bit_length() - 1
    index = min(max(log - 20, 0), INTERVALS - 1)
    divisions = config.roundup_power2_divisions[index]
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << log
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int, config: AllocatorConfig) -> int:
    """The segment cudaMalloc'd for a rounded request no cached block serves."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return config.large_segment_size
    return -(-size // ROUND_LARGE) * ROUND_LARGE


_ADDR_BITS = 64
_ADDR_MASK = (1 << _ADDR_BITS) - 1
"""A cached block in its pool's sorted list: size << _ADDR_BITS | address, one int ordered as
the pair (size, address) is (addresses stay below 2**64), compared faster than a tuple."""


class _Block:
    __slots__ = ("addr", "allocated", "key", "mapped", "next", "pending", "prev", "size")

    def __init__(self, addr: int, size: int, mapped: bool = True):
        self.addr = addr
        self.size = size
        self.allocated = False
        self.mapped = mapped
        self.pending = False  # freed, waiting for another stream's work
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.key: object = None  # the tensor it holds, or the free that left it


@dataclass
class Peak:
    """The moment reserved memory was at its most."""

    reserved: int = 0
    key: object = None
    """The tensor whose malloc reserved the last segment."""
    holes: list = field(default_factory=list)
    """[(bytes, key)]: the largest cached free blocks then, each with the key of the tensor
    whose free left it (largest first, at most eight)."""


class OutOfMemory(Exception):
    def __init__(self, event: int, size: int, reserved: int, allocated: int):
        super().__init__(f"out of memory at event {event}: {size} bytes")
        self.event, self.size, self.reserved, self.allocated = event, size, reserved, allocated


class CachingAllocator:
    """One device's allocator. `capacity`: bytes the allocator may reserve (the device's memory
    less what lives outside it); None for no limit."""

    def __init__(self, config: AllocatorConfig | None = None, capacity: int | None = None):
        self.config = config or AllocatorConfig()
        self._plain = not any(self.config.roundup_power2_divisions)  # 512-byte rounding only
        self._simple = not self.config.expandable_segments and self.config.max_split_size is None
        self.capacity = capacity
        self.free_sets: dict[tuple[int, bool], list[int]] = {}
        """Per pool its cached blocks as `_entry(size, addr)`, sorted: by size, then address."""
        self.by_addr: dict[int, _Block] = {}
        self.live: dict[object, tuple[_Block, tuple[int, bool]]] = {}
        self.streams_used: dict[object, set[int]] = {}
        self.pending: list[tuple[_Block, tuple[int, bool]]] = []
        self.expandable: dict[tuple[int, bool], _Block] = {}  # the unmapped tail per pool
        self.bases: dict[tuple[int, bool], int] = {}  # where each expandable segment starts
        self.next_addr = 1 << 40
        self.reserved = self.allocated = 0
        self.peak = Peak()
        self.peak_allocated = 0
        self.segments = 0
        self.events = 0
        self.retries = 0
        self._key: object = None  # the tensor of the malloc under way
        self.segment_log: list | None = None
        """When a list: (action, address, bytes) of every segment_alloc, segment_free,
        segment_map and segment_unmap, as the allocator's own trace names them."""

    # -------------------------------------------------------------- free-block sets
    def _insert(self, pool: tuple[int, bool], block: _Block) -> None:
        insort(self.free_sets.setdefault(pool, []), block.size << _ADDR_BITS | block.addr)

    def _remove(self, pool: tuple[int, bool], block: _Block) -> None:
        blocks = self.free_sets[pool]
        del blocks[bisect_left(blocks, block.size << _ADDR_BITS | block.addr)]

    def _best_fit(self, pool: tuple[int, bool], size: int) -> _Block | None:
        blocks = self.free_sets.get(pool)
        if not blocks:
            return None
        i = bisect_left(blocks, size << _ADDR_BITS)
        if i == len(blocks):
            return None
        block = self.by_addr[blocks[i] & _ADDR_MASK]
        if self.config.expandable_segments:

            def grows_to(b: _Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            while i + 1 < len(blocks):
                nxt = self.by_addr[blocks[i + 1] & _ADDR_MASK]
                if grows_to(nxt) >= grows_to(block):
                    break
                i, block = i + 1, nxt
        limit = self.config.max_split_size
        if limit is not None:
            if size < limit and block.size >= limit:
                return None
            if size >= limit and block.size >= size + self.config.max_non_split_rounding:
                return None
        del blocks[i]
        return block

    # -------------------------------------------------------------- segments
    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _new_segment(self, pool: tuple[int, bool], size: int) -> _Block | None:
        nbytes = segment_size(size, self.config)
        if not self._fits(nbytes):
            return None
        block = _Block(self.next_addr, nbytes)
        self.next_addr += nbytes + ROUND_LARGE
        self.by_addr[block.addr] = block
        self._reserve(nbytes)
        self.segments += 1
        if self.segment_log is not None:
            self.segment_log.append(("segment_alloc", block.addr, nbytes))
        return block

    def _page(self, pool: tuple[int, bool]) -> int:
        return SMALL_BUFFER if pool[1] else self.config.large_segment_size

    def _grow(self, pool: tuple[int, bool], size: int) -> _Block | None:
        """Expandable segments: map pages at the end of the pool's segment so that its last
        free block (or new pages) holds `size` (try_allocate_expandable_block)."""
        tail = self.expandable.get(pool)
        if tail is None:
            tail = _Block(self.next_addr, 1 << 50, mapped=False)
            self.next_addr += (1 << 50) + ROUND_LARGE
            self.by_addr[tail.addr] = tail
            self.expandable[pool] = tail
            self.bases[pool] = tail.addr
            self.segments += 1
        start = tail.prev if tail.prev is not None and self._is_free(tail.prev) else None
        have = start.size if start is not None else 0
        page = self._page(pool)
        nbytes = -(-(size - have) // page) * page
        if not self._fits(nbytes):
            return None
        self._reserve(nbytes)
        if self.segment_log is not None:
            self.segment_log.append(("segment_map", tail.addr, nbytes))
        del self.by_addr[tail.addr]
        if start is not None:
            self._remove(pool, start)
            start.size += nbytes
            block = start
        else:
            block = _Block(tail.addr, nbytes)
            self.by_addr[block.addr] = block
            block.prev, tail.prev = tail.prev, block
            if block.prev is not None:
                block.prev.next = block
            block.next = tail
        tail.addr += nbytes
        tail.size -= nbytes
        self.by_addr[tail.addr] = tail
        return block

    def _is_free(self, block: _Block) -> bool:
        return block.mapped and not block.allocated and not block.pending

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak.reserved:
            largest = sorted(
                (entry for blocks in self.free_sets.values() for entry in blocks[-8:]),
                reverse=True,
            )[:8]
            holes = [
                (entry >> _ADDR_BITS, self.by_addr[entry & _ADDR_MASK].key) for entry in largest
            ]
            self.peak = Peak(self.reserved, self._key, holes)

    def release_cached(self) -> int:
        """Free every cached segment that holds nothing; with expandable segments, unmap the
        free pages at each segment's end (release_cached_blocks). Bytes released."""
        released = 0
        for pool, blocks in self.free_sets.items():
            for entry in list(blocks):
                size, addr = entry >> _ADDR_BITS, entry & _ADDR_MASK
                block = self.by_addr[addr]
                if self.config.expandable_segments:
                    tail = block.next
                    if tail is None or tail.mapped:
                        continue
                    page, base = self._page(pool), self.bases[pool]
                    keep = -(-(block.addr - base) // page) * page + base - block.addr
                    nbytes = block.size - keep
                    if nbytes <= 0:
                        continue
                    self._remove(pool, block)
                    del self.by_addr[tail.addr]
                    if keep:
                        block.size = keep
                        self._insert(pool, block)
                    else:  # before the tail takes its address
                        del self.by_addr[block.addr]
                        tail.prev = block.prev
                        if block.prev is not None:
                            block.prev.next = tail
                    tail.addr -= nbytes
                    tail.size += nbytes
                    if self.segment_log is not None:
                        self.segment_log.append(("segment_unmap", tail.addr, nbytes))
                    self.by_addr[tail.addr] = tail
                elif block.prev is None and block.next is None:
                    self._remove(pool, block)
                    del self.by_addr[addr]
                    nbytes = size
                    self.segments -= 1
                    if self.segment_log is not None:
                        self.segment_log.append(("segment_free", addr, size))
                else:
                    continue
                self.reserved -= nbytes
                released += nbytes
        return released

    # -------------------------------------------------------------- the API
    def malloc(self, key: object, size: int, stream: int = 0) -> None:
        """Allocate `size` bytes for the tensor `key` on `stream`."""
        self.events += 1
        self._key = key
        if self.pending:
            self._process_events()
        if self._plain:
            rounded = -(-size // MIN_BLOCK) * MIN_BLOCK if size > MIN_BLOCK else MIN_BLOCK
        else:
            rounded = round_size(size, self.config)
        small = rounded <= SMALL_SIZE
        pool = (stream, small)
        if self._simple:  # _best_fit without its rules for expandable segments and max_split
            blocks = self.free_sets.get(pool)
            block = None
            if blocks:
                i = bisect_left(blocks, rounded << _ADDR_BITS)
                if i < len(blocks):
                    block = self.by_addr[blocks.pop(i) & _ADDR_MASK]
        else:
            block = self._best_fit(pool, rounded)
        if block is None:
            grow = self._grow if self.config.expandable_segments else self._new_segment
            block = grow(pool, rounded)
            if block is None and self.release_cached():
                self.retries += 1
                block = grow(pool, rounded)
            if block is None:
                raise OutOfMemory(self.events, rounded, self.reserved, self.allocated)
        rest = block.size - rounded
        if small or self.config.expandable_segments:
            split = rest >= MIN_BLOCK
        else:
            limit = self.config.max_split_size
            split = (limit is None or rounded < limit) and rest > SMALL_SIZE
        if split:
            addr = block.addr + rounded
            remaining = _Block(addr, rest)
            self.by_addr[addr] = remaining
            after = block.next
            remaining.prev, remaining.next = block, after
            if after is not None:
                after.prev = remaining
            block.next = remaining
            block.size = rounded
            remaining.key = block.key
            insort(self.free_sets.setdefault(pool, []), rest << _ADDR_BITS | addr)
        block.allocated = True
        block.key = key
        self.live[key] = (block, pool)
        self.allocated += rounded if split else block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated

    def segment_blocks(self) -> list[list]:
        """Every mapped segment's blocks in address order (a segment: the blocks linked from
        one without a predecessor, an expandable segment's unmapped rest left out)."""
        heads = [b for b in self.by_addr.values() if b.prev is None and b.mapped]
        out = []
        for head in sorted(heads, key=lambda b: b.addr):
            blocks: list[_Block] = []
            block: _Block | None = head
            while block is not None and block.mapped:
                blocks.append(block)
                block = block.next
            out.append(blocks)
        return out

    def rename(self, old: object, new: object) -> None:
        """The tensor `old` is known as `new` from now on."""
        block, pool = self.live[new] = self.live.pop(old)
        block.key = new

    def record_stream(self, key: object, stream: int) -> None:
        """The tensor `key` is used on `stream` too (Tensor.record_stream)."""
        block, pool = self.live[key]
        if stream != pool[0]:
            self.streams_used.setdefault(key, set()).add(stream)

    def free(self, key: object) -> None:
        """Free the tensor `key`; a block used on other streams waits for their work."""
        block, pool = self.live.pop(key)
        self.allocated -= block.size
        block.allocated = False
        if self.streams_used.pop(key, None):
            block.pending = True
            self.pending.append((block, pool))
            return
        self._cache(block, pool)

    def _process_events(self) -> None:
        while self.pending:
            block, pool = self.pending.pop()
            block.pending = False
            self._cache(block, pool)

    def _cache(self, block: _Block, pool: tuple[int, bool]) -> None:
        """Return a block to its pool, merged with its free neighbours (free_block)."""
        by_addr = self.by_addr
        blocks = self.free_sets.setdefault(pool, [])
        del by_addr[block.addr]
        prev = block.prev
        if prev is not None and prev.mapped and not prev.allocated and not prev.pending:
            del blocks[bisect_left(blocks, prev.size << _ADDR_BITS | prev.addr)]
            del by_addr[prev.addr]
            block.addr, block.prev = prev.addr, prev.prev
            if prev.prev is not None:
                prev.prev.next = block
            block.size += prev.size
        nxt = block.next
        if nxt is not None and nxt.mapped and not nxt.allocated and not nxt.pending:
            del blocks[bisect_left(blocks, nxt.size << _ADDR_BITS | nxt.addr)]
            del by_addr[nxt.addr]
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
            block.size += nxt.size
        by_addr[block.addr] = block
        insort(blocks, block.size << _ADDR_BITS | block.addr)
