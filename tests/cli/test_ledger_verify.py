"""`infernet ledger verify FILE` checks an export file without an agent (IPIP-0008 §6); errors are one line.
Also the offline side of `data get` and of a spec whose dataset is a CID."""

from __future__ import annotations

import json

from tests.cli.conftest import REPO, assert_one_line_error, cli

VECTORS = json.loads((REPO / "ipips/vectors/ledger-export.json").read_text())


def test_ledger_verify_accepts_the_vector_and_names_the_bad_entry_of_a_tampered_one(tmp_path):
    good = tmp_path / "ledger.json"
    good.write_text(json.dumps(VECTORS["valid"]["document"]))
    done = cli("ledger", "verify", str(good), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["chains"] == VECTORS["valid"]["chains"]

    case = next(c for c in VECTORS["invalid"] if c["name"] == "a signature flipped")
    bad = tmp_path / "tampered.json"
    bad.write_text(json.dumps(case["document"]))
    assert_one_line_error(cli("ledger", "verify", str(bad)), f"{bad}: chains[1].entries[2]: bad signature")
    (tmp_path / "junk.json").write_text("{not json")
    assert_one_line_error(cli("ledger", "verify", str(tmp_path / "junk.json")), "junk.json: not JSON")


def test_data_get_without_an_agent_says_so(tmp_path):
    done = cli("data", "get", "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4", "--out",
               str(tmp_path / "f"), "--home", str(tmp_path / "nohome"))
    assert_one_line_error(done, "no agent is running")


def test_a_spec_naming_its_dataset_by_cid_needs_no_local_file(tmp_path):
    spec = tmp_path / "infernet.train.yml"
    spec.write_text("name: x\nbase_model: infernet-tiny\n"
                    "input: {dataset: 'ipfs://bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4'}\n")
    done = cli("job", "announce", str(spec), "--home", str(tmp_path / "nohome"))
    assert_one_line_error(done, "no agent is running")  # not "no such file": the agent fetches the CID
    spec.write_text("name: x\nbase_model: infernet-tiny\ninput: {dataset: 'ipfs://nope'}\n")
    assert_one_line_error(cli("job", "announce", str(spec), "--home", str(tmp_path / "nohome")),
                          "infernet.train.yml:3: input.dataset: not an IPFS CID")
