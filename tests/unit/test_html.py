"""The HTML page's pieces that need no trace: timeline columns, refused output paths (the page
of a traced job is in tests/tracing/test_html.py)."""

import pytest

from metatrace.export import html as page_html
from tests.helpers import DEBUG, metatrace


def test_long_timelines_are_drawn_as_the_highest_level_of_their_steps():
    steps = [("forward", i) for i in range(1000)] + [("backward", 5000), ("optimizer", 1)]
    cols = page_html._columns(steps)
    assert len(cols) == 501 and cols[0] == ("forward", 1)
    assert cols[-1] == (None, 5000)  # a backward and the optimizer step: mixed


@pytest.mark.parametrize("flag", ["--html", "--json"])
def test_bad_output_paths_exit_2_naming_the_flag(tmp_path, flag):
    missing = metatrace("run", "--config", DEBUG, flag, "/nonexistent/dir/out")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    message = f"{flag} /nonexistent/dir/out: directory /nonexistent/dir does not exist"
    assert message in missing.stderr
    directory = metatrace("run", "--config", DEBUG, flag, str(tmp_path))
    assert directory.returncode == 2
    assert f"{flag} {tmp_path} is a directory" in directory.stderr
