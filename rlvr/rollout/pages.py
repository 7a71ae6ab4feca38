"""Host-side bookkeeping of KV pages: a free list with reference counts (shared prefixes)."""

from __future__ import annotations


class PagePool:
    """Pages 1..capacity-1 are allocatable; page 0 is a scratch page that unused page-table
    entries point at (it is never read unmasked and never written by a live row)."""

    def __init__(self, capacity: int):
        if capacity < 2:
            raise ValueError("a page pool needs at least 2 pages")
        self.capacity = capacity
        self.reset()

    def reset(self) -> None:
        self.refs = [0] * self.capacity
        self.free = list(range(self.capacity - 1, 0, -1))

    def can_allocate(self, count: int) -> bool:
        return len(self.free) >= count

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError(f"KV page pool exhausted: need {count}, {len(self.free)} free; "
                               "raise num_pages or lower max_slots/max_len")
        pages = [self.free.pop() for _ in range(count)]
        for page in pages:
            self.refs[page] = 1
        return pages

    def share(self, pages: list[int]) -> list[int]:
        for page in pages:
            self.refs[page] += 1
        return list(pages)

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)

    @property
    def used(self) -> int:
        return self.capacity - 1 - len(self.free)
