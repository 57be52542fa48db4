"""The delivery board (ipc/delivery.py): postprocess marks how far it has taken each stream, llm reads it."""

import os
import subprocess
import sys

import pytest

from ipc import delivery


@pytest.fixture
def boards(tmp_path, monkeypatch):
    monkeypatch.setattr(delivery, "BOARDS", tmp_path / "boards")
    return tmp_path / "boards"


def test_a_mark_reaches_the_board_of_the_llm_the_id_names(boards):
    board, marker = delivery.Board(), delivery.Marker()
    try:
        seven = f"{os.getpid()}-7"
        assert board.delivered(seven) is None and not board.changed()
        marker.mark(seven, 3)
        assert board.changed() and board.delivered(seven) == 3 and not board.changed()
        marker.mark(seven, 5)
        assert board.changed() and board.delivered(seven) == 5
        assert board.delivered(f"{os.getpid()}-8") is None
    finally:
        board.close()
    assert not (boards / str(os.getpid())).exists()


def test_a_slots_new_generation_is_told_from_its_old_one(boards):
    """Generation n and n + SLOTS - 1 share a slot: the tag keeps the newer from reading the older's mark."""
    board, marker = delivery.Board(), delivery.Marker()
    try:
        old, new = f"{os.getpid()}-5", f"{os.getpid()}-{5 + delivery.SLOTS - 1}"
        marker.mark(old, 9)
        assert board.delivered(old) == 9 and board.delivered(new) is None
        marker.mark(new, 2)
        assert board.delivered(new) == 2 and board.delivered(old) is None
    finally:
        board.close()


@pytest.mark.parametrize("generation_id", ["", "7", "x-1", "1-2-3", "../../etc-1", f"{2**40}-1"])
def test_ids_llm_could_not_have_made_and_boards_that_are_gone_are_ignored(boards, generation_id):
    board, marker = delivery.Board(), delivery.Marker()
    try:
        marker.mark(generation_id, 1)
        marker.mark("999999999-1", 1)  # no such llm
        marker.mark(f"{os.getpid()}-1", 2**32)  # more tokens than a word's half holds
        assert not board.changed() and board.delivered(f"{os.getpid()}-1") is None
    finally:
        board.close()


def test_the_sweep_removes_the_boards_of_llm_stubs_that_ended(boards):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    board = delivery.Board()
    try:
        (boards / ended.stdout.strip()).write_bytes(b"\0" * 8)
        delivery.sweep()
        assert sorted(p.name for p in boards.iterdir()) == [str(os.getpid())]
    finally:
        board.close()
