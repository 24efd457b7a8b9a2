"""Notebook 09b's exercise checker accepts the reference solution and rejects planted mistakes, naming them."""
import pytest

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.memory_sharding import fsdp2_exercises as checkers


def test_local_rows_solution_passes(capsys):
    checkers.check_local_rows(load_solution("fsdp_in_practice", "local_rows"))
    assert "passed" in capsys.readouterr().out


def _tensor_split(rows, rank, world_size):  # balanced: 5 rows on 4 ranks -> 2, 1, 1, 1
    base, extra = divmod(rows, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def _padded(rows, rank, world_size):  # the padded shard, padding rows included
    size = -(-rows // world_size)
    return rank * size, size


def _floor(rows, rank, world_size):  # rows // n each, the remainder lost
    return rank * (rows // world_size), rows // world_size


@pytest.mark.parametrize("wrong, named", [
    (_tensor_split, "tensor_split"),
    (_padded, "padded size"),
    (_floor, "fully_shard gave"),
    (lambda rows, rank, world_size: [0, rows], "a tuple"),
])
def test_local_rows_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_local_rows(wrong)
