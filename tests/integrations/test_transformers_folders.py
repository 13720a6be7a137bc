"""Which ``checkpoint-N`` folders fastckpt.transformers counts (finished ones only) and how ``save_total_limit``
rotates them: numeric order (case C27), the newest and the best checkpoint always kept, unfinished saves untouched."""

from __future__ import annotations

import pytest

from fastckpt.transformers import folders


def make(root, n: int, kind: str = "fastckpt"):
    folder = root / f"checkpoint-{n}"
    folder.mkdir()
    if kind == "fastckpt":
        (folder / "fastckpt.json").write_text("{}")
    elif kind == "stock":
        (folder / "trainer_state.json").write_text("{}")
    elif kind == "unfinished":  # fastckpt files without the manifest, or a stock save cut before its state
        (folder / "optimizer.safetensors").write_bytes(b"")
        (folder / "trainer_state.json").write_text("{}")
    return folder


def test_numeric_order_and_the_newest_kept(tmp_path):
    for n in (9, 10, 100, 1000):
        make(tmp_path, n)
    assert folders.latest_checkpoint(tmp_path).name == "checkpoint-1000"
    removed = folders.rotate(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["checkpoint-10", "checkpoint-9"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-100", "checkpoint-1000"]


def test_the_best_checkpoint_is_kept(tmp_path):
    for n in (2, 4, 6, 8):
        make(tmp_path, n)
    folders.rotate(tmp_path, 1, best=str(tmp_path / "checkpoint-4"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-8"]


def test_unfinished_saves_neither_count_nor_go(tmp_path):
    make(tmp_path, 4)
    make(tmp_path, 6, "stock")
    make(tmp_path, 8, "unfinished")
    make(tmp_path, 10, "empty")
    assert sorted(folders.finished_checkpoints(tmp_path)) == [4, 6]
    assert folders.latest_checkpoint(tmp_path).name == "checkpoint-6"
    folders.rotate(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-6", "checkpoint-8"]


@pytest.mark.parametrize("limit", [None, 0, -1])
def test_no_limit_keeps_everything(tmp_path, limit):
    for n in (1, 2, 3):
        make(tmp_path, n)
    assert folders.rotate(tmp_path, limit) == []
    assert len(list(tmp_path.iterdir())) == 3


def test_an_absent_output_dir_has_no_checkpoint(tmp_path):
    assert folders.latest_checkpoint(tmp_path / "absent") is None
