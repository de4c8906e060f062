"""benchmarks/results_file.py: a rerun goes on top and keeps every earlier run byte for byte."""

from benchmarks.results_file import EARLIER, write_run


def test_first_run_is_the_whole_file(tmp_path):
    path = tmp_path / "sub" / "bench.txt"
    write_run(path, "run 1\nfigure 3.0")
    assert path.read_text() == "run 1\nfigure 3.0\n"


def test_a_rerun_keeps_the_earlier_runs_below_a_marker(tmp_path):
    path = tmp_path / "bench.txt"
    earlier = "run 1\n\n(a reading written by hand, with  trailing spaces  \n\n"
    path.write_text(earlier)
    write_run(path, "run 2\n\n\n")
    assert path.read_text() == f"run 2\n\n{EARLIER}\n{earlier}"
    write_run(path, "run 3")
    text = path.read_text()
    assert text.startswith("run 3\n\n" + EARLIER + "\nrun 2\n")
    assert text.endswith(earlier) and text.count(EARLIER) == 2


def test_an_empty_file_is_replaced(tmp_path):
    path = tmp_path / "bench.txt"
    path.write_text("\n\n")
    write_run(path, "run 1")
    assert path.read_text() == "run 1\n"


def test_a_run_made_elsewhere_joins_the_files_on_top(tmp_path):
    """The lent GPU machine writes one run into an empty folder; merging it puts each file on top
    of its namesake (new files are created), earlier runs kept below."""
    from benchmarks.results_file import EARLIER, merge_dir

    source, dest = tmp_path / "device", tmp_path / "results"
    source.mkdir()
    dest.mkdir()
    (dest / "engine.txt").write_text("old run\n")
    (source / "engine.txt").write_text("new run\n")
    (source / "tests.txt").write_text("74 passed\n")
    merge_dir(source, dest)
    assert (dest / "engine.txt").read_text() == f"new run\n\n{EARLIER}\nold run\n"
    assert (dest / "tests.txt").read_text() == "74 passed\n"
