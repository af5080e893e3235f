"""The decoder fuzzer (scripts/fuzz_decoders.py) in its short CI mode, and proof that it can find things.

The full 100,000-case run is a separate command: ``python scripts/fuzz_decoders.py``.
"""

from protocol import envelope
from scripts import fuzz_decoders as fuzz


def test_short_fuzz_run_finds_nothing(capsys):
    assert fuzz.main(["--short"]) == 0
    out = capsys.readouterr().out
    assert f"{fuzz.SHORT_CASES} cases" in out
    for name, _weight in fuzz.TARGETS:  # every target got cases
        row = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert int(row.split()[1]) > 0, row
    assert "bad-signature" in out  # byte mutants get as deep as the signature check
    assert "bad-field" in out  # re-signed mutants get as deep as the body validation


def test_every_message_type_is_seeded():
    assert {type(msg).TYPE for msg in fuzz.sample_messages()} == set(fuzz.m.MESSAGE_TYPES)


def test_a_crashing_decoder_is_a_finding_with_a_reproducer(monkeypatch, capsys):
    def crashing_decode_node(data):
        if len(data) > 3:
            raise IndexError("boom")
        return None

    monkeypatch.setattr(fuzz, "decode_node", crashing_decode_node)
    assert fuzz.main(["--cases", "300", "--seed", "3"]) == 1
    out = capsys.readouterr().out
    assert "FINDING" in out and "IndexError: boom" in out and "reproducer (hex): " in out


def test_an_envelope_opened_without_its_signature_is_a_finding(monkeypatch, capsys):
    # With signatures unchecked, a byte flip inside a string of the body can open: a forgery.
    monkeypatch.setattr(envelope, "verify_signature", lambda *args: True)
    assert fuzz.main(["--cases", "2000", "--seed", "4"]) == 1
    assert "forgery accepted" in capsys.readouterr().out
