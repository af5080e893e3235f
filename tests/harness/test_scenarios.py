"""The shipped scenarios pass against real agents; scenario files are read strictly; traces are useful."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from agent.harness.network import identity_for
from agent.harness.scenario import load_scenario, parse_scenario, run_scenario, shipped
from agent.harness.trace import read_trace
from protocol.errors import SpecError

REPO = Path(__file__).resolve().parents[2]
SHIPPED = {p.stem: p for p in shipped()}
REQUIRED = {"happy-path", "worker-crash", "coordinator-crash", "partition-heal", "byzantine-adapter", "forged-proof",
            "tampered-dataset", "gossip-flood", "late-joiner", "all-workers-fail", "failover-ban"}


def _params():
    for name, path in sorted(SHIPPED.items()):
        marks = [pytest.mark.network]
        if load_scenario(path).slow:
            marks.append(pytest.mark.slow)
        yield pytest.param(name, marks=marks, id=name)


# -- reading ---------------------------------------------------------------------------------------


def test_the_required_scenarios_ship_and_parse():
    assert REQUIRED <= set(SHIPPED), REQUIRED - set(SHIPPED)
    for name, path in SHIPPED.items():
        scenario = load_scenario(path)
        assert scenario.name == name, f"{path}: name {scenario.name!r} differs from the file name"
        assert scenario.description.strip()
        scenario.spec()  # the job keys make a valid job spec


GOOD = """\
name: t
agents: {workers: 2, mallory: true}
faults:
  - when: training
    kill: trainer
  - at: 3
    attack: {kind: replay, count: 5}
expect: {phase: DONE}
"""

BAD = [
    ("name: t\nagnets: {}\n", "x.yml:2: agnets: unknown key (did you mean 'agents'?)"),
    ("agents: {workers: 2}\n", "x.yml: name: required key is missing"),
    ("name: t\nagents: {workers: 0}\n", "x.yml:2: agents.workers: must be between 1 and 16, got 0"),
    ("name: t\nagents:\n  byzantine: {w7: random_adapter}\n",
     "x.yml:3: agents.byzantine.w7: no agent called 'w7' (agents: w0, w1, w2)"),
    ("name: t\nagents:\n  byzantine: {w0: lazy}\n", "x.yml:3: agents.byzantine.w0: expected one of"),
    ("name: t\njob:\n  shards: 0\n", "x.yml:3: job.shards:"),
    ("name: t\njob:\n  training: {learnig_rate: 1}\n", "x.yml:3: job.training.learnig_rate: unknown key"),
    ("name: t\nfaults:\n  - at: 1\n    kill: w9\n", "x.yml:4: faults[0].kill: no agent called 'w9'"),
    ("name: t\nfaults:\n  - kill: w0\n", "x.yml:3: faults[0]: a fault has either 'at'"),
    ("name: t\nfaults:\n  - at: 1\n    kill: w0\n    heal: true\n", "faults[0]: a fault has exactly one action"),
    ("name: t\nfaults:\n  - when: soon\n    kill: w0\n", "x.yml:3: faults[0].when: expected one of training"),
    ("name: t\nfaults:\n  - at: 1\n    attack: {kind: replay}\n", "an attack needs agents.mallory: true"),
    ("name: t\nfaults:\n  - at: 1\n    start: w1\n", "only agents listed in agents.late are started by a fault"),
    ("name: t\nexpect: {phase: done}\n", "x.yml:2: expect.phase: expected one of DONE, FAILED, CANCELLED"),
    ("name: t\nexpect: {trained: [w5]}\n", "x.yml:2: expect.trained[0]: no agent called 'w5'"),
    ("name: t\nexpect: {recovered: 1}\n", "x.yml:2: expect.recovered:"),
    ("name: t\nseed: &a 1\ntimeout: *a\n", "x.yml:3: YAML aliases (*name) are not allowed"),
    ("name: t\nname: u\n", "x.yml:2: name: duplicate key (first given at line 1)"),
    ("", "x.yml:1: expected a mapping of scenario settings at the top level"),
]


def test_a_good_scenario_reads_into_faults_and_expectations():
    scenario = parse_scenario(GOOD, "x.yml")
    assert scenario.workers == 2 and scenario.mallory
    kill, replay = scenario.faults
    assert (kill.action, kill.value, kill.when, kill.line) == ("kill", "trainer", "training", 4)
    assert (replay.action, replay.value, replay.at) == ("attack", {"kind": "replay", "count": 5}, 3.0)
    assert scenario.expect == {"phase": "DONE"}


@pytest.mark.parametrize("text, message", BAD, ids=[m[:40] for _, m in BAD])
def test_a_bad_scenario_is_one_line_naming_file_line_and_field(text, message):
    with pytest.raises(SpecError) as error:
        parse_scenario(text, "x.yml")
    assert message in str(error.value), str(error.value)
    assert "\n" not in str(error.value)


def test_cli_check_reports_a_bad_scenario_in_one_line_and_exits_1(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("name: t\nfaults:\n  - at: 1\n    kill: w9\n")
    done = subprocess.run([sys.executable, "-m", "agent.cli", "harness", "check", str(bad)], capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == f"infernet: {bad}:4: faults[0].kill: no agent called 'w9' (agents: submitter, " \
                                  "w0, w1, w2; or one of: coordinator, trainer, workers, killed)"
    ok = subprocess.run([sys.executable, "-m", "agent.cli", "harness", "check", "happy-path"], capture_output=True,
                        text=True, cwd=REPO, timeout=60)
    assert ok.returncode == 0 and "ok (happy-path" in ok.stdout


def test_recovered_needs_work_from_behind_a_nat_accepted_after_the_kill(tmp_path):
    # relay-down's own expectation: a circuit served or a job DONE can both happen before the kill
    from agent.harness.scenario import _Run

    scenario = load_scenario(SHIPPED["relay-down"])
    assert scenario.expect["recovered"] is True
    run = _Run(scenario, 1, tmp_path)
    assert not run._recovered_check(True).ok  # no kill fired
    run.fired = [(4.0, "kill w0")]
    run.accepted_at = [(3.0, "w1"), (6.0, "w0")]  # w1's before the kill; w0 is not behind a NAT
    check = run._recovered_check(True)
    assert not check.ok and "no work of an agent behind NAT (w1, w2) accepted after the kill" in check.detail
    run.accepted_at.append((9.0, "w2"))
    check = run._recovered_check(True)
    assert check.ok and check.detail.startswith("work of w2 (behind NAT) accepted after the kill at 4.0 s")


def test_identities_are_seeded():
    assert identity_for(1, "w0").peer_id == identity_for(1, "w0").peer_id
    assert identity_for(1, "w0").peer_id != identity_for(2, "w0").peer_id != identity_for(1, "w1").peer_id


# -- running ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(_params()))
def test_shipped_scenario_passes_against_real_agents(name, tmp_path, tiny_model_dir):
    scenario = load_scenario(SHIPPED[name])
    if scenario.hosts:
        from agent.harness.hosts import scenario_unavailable

        reason = scenario_unavailable(scenario.hosts)
        if reason:
            pytest.skip(f"{name} places agents on hosts: {reason}")
    result = trio.run(lambda: run_scenario(scenario, tmp_path / name, model_dir=tiny_model_dir))
    assert result.ok, result.summary
    lines = read_trace(result.trace_path)
    kinds = {line["kind"] for line in lines}
    assert {"start", "job", "recv", "state", "check", "end"} <= kinds
    assert lines[0]["kind"] == "start" and lines[0]["seed"] == scenario.seed
    assert lines[-1] == {**lines[-1], "kind": "end", "ok": True}
    if scenario.faults:
        fired = [line for line in lines if line["kind"] == "fault"]
        assert len(fired) == len(scenario.faults), result.summary
    assert len(result.summary.splitlines()) <= 40  # one screen
    json.dumps(result.facts)


@pytest.fixture(scope="module")
def tiny_model_dir() -> Path:
    from agent.train.tiny import tiny_model

    return tiny_model()


def test_process_agents_are_read_and_cannot_be_byzantine():
    scenario = parse_scenario("name: t\nagents: {workers: 3, processes: [w1, w2]}\n", "x.yml")
    assert scenario.processes == ("w1", "w2") and scenario.name == "t"
    with pytest.raises(SpecError) as error:
        parse_scenario("name: t\nagents:\n  byzantine: {w1: forged_chain}\n  processes: [w1]\n", "x.yml")
    assert str(error.value).startswith("x.yml:4: agents.processes[0]: w1 is Byzantine")


@pytest.mark.network
def test_the_same_seed_replays_the_same_decisions(tmp_path, tiny_model_dir):
    """Identities, job ID, the elected coordinator and the outcome follow from the seed alone."""
    scenario = load_scenario(SHIPPED["all-workers-fail"])

    def run(seed: int, where: str):
        result = trio.run(lambda: run_scenario(scenario, tmp_path / where, seed=seed, model_dir=tiny_model_dir))
        lines = read_trace(result.trace_path)
        coordinators = [line["coordinator"] for line in lines if line["kind"] == "state" and line["agent"] == "submitter"]
        return result, lines[0]["agents"], coordinators

    first, agents1, coordinators1 = run(8, "a")
    again, agents2, coordinators2 = run(8, "b")
    assert first.ok and again.ok, first.summary + "\n" + again.summary
    assert agents1 == agents2 and first.job_id == again.job_id
    assert coordinators1[0] == coordinators2[0] and set(coordinators1) == set(coordinators2) == {coordinators1[0]}
    assert (first.phase, first.reason) == (again.phase, again.reason)
    assert agents1["w0"] == identity_for(8, "w0").peer_id
    other = parse_scenario(SHIPPED["all-workers-fail"].read_text().replace("seed: 8", "seed: 9"), "other.yml")
    assert other.seed == 9 and identity_for(9, "w0").peer_id != agents1["w0"]


def test_the_readme_example_scenario_is_valid():
    text = (REPO / "README.md").read_text()
    start = text.index("  name: my-scenario")
    block = "\n".join(line[2:] for line in text[start:text.index("```", start)].splitlines())
    scenario = parse_scenario(block, "README.md")
    assert scenario.name == "my-scenario" and len(scenario.faults) == 9 and scenario.processes == ("w2",)


def test_a_cut_names_pairs_of_two_agents():
    scenario = parse_scenario("name: t\nfaults:\n  - at: 0\n    cut: [[w0, w2]]\n", "x.yml")
    assert scenario.faults[0].value == [["w0", "w2"]]
    for bad in ("[[w0]]", "[[w0, w0]]", "[[w0, w1, w2]]"):
        with pytest.raises(Exception, match=r"x.yml:4: faults\[0\].cut\[0\]: expected a pair of two agents"):
            parse_scenario(f"name: t\nfaults:\n  - at: 0\n    cut: {bad}\n", "x.yml")
