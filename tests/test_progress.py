"""Progress drawn from the ranks' records: what each bar counts, ranks' own totals, and how a run ended."""
from __future__ import annotations

from labsrc.core.progress import PlainProgress
from labsrc.core.runs import RecordWriter


def test_plain_lines_say_what_they_count_per_rank_and_end_on_how_the_run_ended(tmp_path, capsys):
    progress = PlainProgress("demo", 2, tmp_path, every_s=0.0)
    first, second = RecordWriter(tmp_path, 0), RecordWriter(tmp_path, 1)
    first.progress(3, 12, unit="micro-batches")
    second.progress(1, 10, unit="micro-batches")   # ranks may count to different totals
    progress.update()
    progress.update()                               # nothing new: no second line
    first.progress(12, 12, unit="micro-batches")
    progress.close("failed")
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[progress] demo: rank0 3/12 micro-batches | rank1 1/10 micro-batches",
                     "[progress] demo: failed (rank0 12/12 micro-batches | rank1 1/10 micro-batches)"]


def test_a_run_without_progress_records_still_ends_on_done(tmp_path, capsys):
    progress = PlainProgress("quiet", 1, tmp_path)
    progress.update()
    progress.close("done")
    assert capsys.readouterr().out.splitlines() == ["[progress] quiet: done"]
