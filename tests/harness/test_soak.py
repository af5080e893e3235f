"""The chaos soak, short (issue 21): agent processes run jobs back to back while seeded faults hit them,
and no invariant breaks. The long one (30 minutes, 6+ agents) is in the README with its figures:
`infernet harness soak --minutes 30 --agents 6`."""

from __future__ import annotations

import pytest

from agent.harness.soak import Soak, SoakOptions
from tests.cli.conftest import cli

pytestmark = pytest.mark.network


def test_a_short_soak_breaks_no_invariant(tmp_path):
    # 18 s of faults from when every agent is up, each of a kind that can be made at that moment (4 with this seed;
    # before, the time counted from the start and most draws found no room: 2 faults in CI's run of 30 s)
    soak = Soak(SoakOptions(minutes=0.3, agents=3, seed=4, fault_every=4.0, max_joins=1, directory=tmp_path / "soak"))
    report = soak.run()
    assert not report.violations, "\n".join(report.violations)
    assert report.faults_injected >= 3, report.faults
    assert report.jobs and all(job["state"] in ("DONE", "FAILED", "CANCELLED") for job in report.jobs), report.jobs
    lines = report.bench_lines()
    assert {line["bench"] for line in lines} >= {"soak_faults_injected", "soak_violations", "soak_accepted_work_lost"}
    assert next(line for line in lines if line["bench"] == "soak_violations")["ratio"] == 1.0


def test_soak_arguments_are_checked_in_one_line(tmp_path):
    for args, message in ((["--minutes", "0"], "--minutes: must be between 0 and 1440"),
                          (["--agents", "2"], "--agents: must be between 3 and 16")):
        done = cli("harness", "soak", *args, "--out", str(tmp_path / "x"))
        assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
