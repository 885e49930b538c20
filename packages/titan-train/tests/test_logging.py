"""titan's log format, and a library's own console lines printed once, not twice."""

from __future__ import annotations

import logging
import sys

import pytest
from titan.train.engine import setup_logging


@pytest.fixture
def restored_root_logger():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:], root.level = handlers, level


def test_a_library_line_printed_by_its_own_handler_is_not_printed_again(restored_root_logger, capsys):
    library = logging.getLogger("some_library")  # as `datasets` and `huggingface_hub` set theirs up
    library.addHandler(logging.StreamHandler(sys.stderr))
    try:
        setup_logging(rank=0)
        logging.getLogger("some_library.http").warning("Retrying in 4s")
        logging.getLogger("titan.something").info("step 1")
        logging.getLogger("quiet_library").warning("a library without its own handler")
    finally:
        library.handlers.clear()
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if "Retrying" in line] == ["Retrying in 4s"]  # once, as the library printed it
    assert any(line.startswith("[titan ") and line.endswith("] step 1") for line in lines)
    assert any(line.endswith("] a library without its own handler") for line in lines)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_prefix_names_the_part_and_only_its_first_rank_logs_info(restored_root_logger, capsys, rank):
    setup_logging(rank=rank, prefix="titan generator")
    logging.getLogger("titan.rl").info("serving")
    logging.getLogger("titan.rl").warning("slow")
    lines = capsys.readouterr().err.splitlines()
    assert [line.startswith("[titan generator ") for line in lines] == [True] * len(lines)
    assert [line.split("] ", 1)[1] for line in lines] == (["serving", "slow"] if rank == 0 else ["slow"])
