"""Write guards shared by several tensors (``WriteGuard.guard_many``): tensors whose pages lie at most ``MERGE_GAP``
apart get one registration and one write-protect call, yet each is asked only about its own pages, and a
released tensor's pages are no longer protected while the others' still are."""

from __future__ import annotations

import pytest
import torch

from fastckpt._io.async_save import write_guard

PAGE = write_guard._PAGE


@pytest.fixture
def guard():
    g = write_guard.WriteGuard.open()
    if g is None:
        pytest.skip(f"write guards unavailable here: {write_guard._refused}")
    yield g
    g.close()


def _pages(n: int) -> tuple[torch.Tensor, int]:
    """A zeroed uint8 buffer of ``n`` whole pages (plus slack) and the offset of its first whole page."""
    base = torch.zeros((n + 1) * PAGE, dtype=torch.uint8)
    return base, (-base.data_ptr()) % PAGE


def _calls(monkeypatch) -> list[int]:
    """Record the request of every ioctl the guard makes."""
    seen: list[int] = []
    real = write_guard._ioctl

    def counted(fd, request, arg):
        seen.append(request)
        return real(fd, request, arg)

    monkeypatch.setattr(write_guard, "_ioctl", counted)
    return seen


def test_tensors_pages_apart_share_one_registration_and_answer_for_their_own_pages(guard, monkeypatch):
    base, off = _pages(8)
    a = base[off : off + 2 * PAGE]
    gap = base[off + 2 * PAGE : off + 3 * PAGE]  # memory between them that nobody guards
    b = base[off + 3 * PAGE : off + 5 * PAGE]
    calls = _calls(monkeypatch)
    gb, ga = guard.guard_many([b, a])  # any order in, each tensor its own Guarded out
    assert calls == [write_guard._UFFDIO_REGISTER, write_guard._UFFDIO_WRITEPROTECT]
    assert (ga.start, ga.length, gb.start, gb.length) == (a.data_ptr(), 2 * PAGE, b.data_ptr(), 2 * PAGE)
    assert ga.region is gb.region and ga.region.left == 2

    gap.fill_(7)  # protected too, but nobody's page: no tensor was written
    assert guard.written(ga) is None and guard.written(gb) is None
    b[PAGE + 5] = 1  # the second page of b
    assert guard.written(gb) == PAGE and guard.written(ga) is None

    assert guard.release(ga) is None and ga.released and gb.region.left == 1
    a.fill_(3)  # released: a plain write, nothing to report for b
    assert guard.written(gb) == PAGE
    assert guard.release(gb) == PAGE and gb.region.left == 0
    assert calls[-1] == write_guard._UFFDIO_UNREGISTER  # the region went with its last tensor
    assert torch.equal(a, torch.full_like(a, 3)) and int(b[PAGE + 5]) == 1 and int(gap.sum()) == 7 * PAGE


def test_a_gap_wider_than_merge_gap_and_merge_gap_zero_guard_each_tensor_alone(guard, monkeypatch):
    base, off = _pages(8)
    a = base[off : off + PAGE]
    b = base[off + 3 * PAGE : off + 4 * PAGE]
    monkeypatch.setattr(write_guard, "MERGE_GAP", PAGE)  # the gap is 2 pages
    ga, gb = guard.guard_many([a, b])
    assert ga.region is None and gb.region is None
    c = base[off + 5 * PAGE : off + 6 * PAGE]
    d = base[off + 6 * PAGE : off + 7 * PAGE]
    monkeypatch.setattr(write_guard, "MERGE_GAP", 0)
    gc, gd = guard.guard_many([c, d])  # touching, but merging is off
    assert gc.region is None and gd.region is None
    d[0] = 1
    assert guard.written(gd) == 0 and guard.written(gc) is None
    for g in (ga, gb, gc):
        assert guard.release(g) is None
    assert guard.release(gd) == 0


def test_a_tensor_overlapping_one_already_guarded_is_not_guarded(guard):
    base, off = _pages(6)
    a = base[off : off + 3 * PAGE]
    view = base[off + PAGE : off + 2 * PAGE]  # the same memory again
    (ga,) = guard.guard_many([a])
    assert guard.guard_many([view]) == [None]
    late = base[off + 4 * PAGE : off + 5 * PAGE]
    first, second = guard.guard_many([late, base[off + 4 * PAGE : off + 5 * PAGE]])
    assert (first is None) != (second is None)  # two views of one page: one guarded, the other hashed instead
    assert guard.release(ga) is None


def test_close_releases_a_region_with_tensors_not_yet_released(guard):
    base, off = _pages(4)
    a = base[off : off + PAGE]
    b = base[off + PAGE : off + 2 * PAGE]
    ga, gb = guard.guard_many([a, b])
    assert guard.release(ga) is None
    guard.close()
    assert gb.released and gb.region.left == 0
    b.fill_(9)  # no longer registered with a closed guard: a plain write
    assert torch.equal(b, torch.full_like(b, 9))


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.parametrize("merge_gap", [0, write_guard.MERGE_GAP], ids=["per tensor", "shared"])
def test_guarding_many_tensors_does_not_split_the_address_space_per_tensor(guard, monkeypatch, merge_gap):
    """Each registration splits the mapping it lies in: one per tensor added two mappings per tensor (a model with
    tens of thousands of state tensors would reach ``vm.max_map_count``, after which every mmap of the process
    fails); shared registrations add a few."""
    base, off = _pages(2 * 300)
    tensors = [base[off + 2 * k * PAGE : off + (2 * k + 1) * PAGE] for k in range(300)]  # a free page between each
    monkeypatch.setattr(write_guard, "MERGE_GAP", merge_gap)
    before = _mappings()
    guarded = guard.guard_many(tensors)
    added = _mappings() - before
    assert all(g is not None for g in guarded)
    if merge_gap:
        assert added <= 2 and len({id(g.region) for g in guarded}) == 1
    else:
        assert added >= 300
    tensors[123][7] = 1
    assert [k for k, g in enumerate(guarded) if guard.written(g) is not None] == [123]
