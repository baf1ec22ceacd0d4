"""The markers' own check (tests/README.md): a test that runs a stage script through conftest's runners
without the `stage` marker fails, so the fast loop never runs a stage unseen; a bench or helper script is
no stage."""
from __future__ import annotations

import conftest
import pytest


class _Unmarked:
    nodeid = "tests/test_x.py::test_y"

    def get_closest_marker(self, name):
        return None


def test_a_stage_script_from_an_unmarked_test_fails_it_and_a_bench_script_does_not(monkeypatch):
    monkeypatch.setattr(conftest, "_running", _Unmarked())
    for script in ("01_build_pairs.py", "05_eval.py"):
        with pytest.raises(pytest.fail.Exception, match="mark it @pytest.mark.stage"):
            conftest._check_marked_stage(script)
    conftest._check_marked_stage("bench/nf4_sweep.py")
    conftest._check_marked_stage("scripts/judges_later_posts.py")


def test_the_running_test_is_the_one_the_check_reads(request):
    assert conftest._running is request.node and request.node.get_closest_marker("stage") is None
