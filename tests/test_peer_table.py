"""The peer table's arrival rule: a peer is new to us at its first heartbeat, even when its capability came
first (a starting agent publishes its capability before its first heartbeat), and again after a silence;
an arrival is what makes us tell it our capability (agent/following.py)."""

from agent.peers import PeerTable
from protocol import messages as m
from protocol.identity import Identity
from scripts.make_envelope_vectors import sample_capability

ME, NEW = (Identity(bytes([i]) * 32).peer_id for i in (1, 2))


def test_a_peer_whose_capability_came_first_arrives_at_its_first_heartbeat_and_again_after_a_silence():
    now = [100.0]
    table = PeerTable(ME, lambda: now[0], heartbeat_seconds=1.0, missed_heartbeats=5, ours=lambda: None)
    beat = m.Heartbeat(1, 0, ())
    table.told(NEW, sample_capability(), now[0])  # what a starting agent sends first
    assert table.heard(NEW, beat, now[0] + 0.1)  # (before the fix: False, and nobody told it anything)
    assert not table.heard(NEW, beat, now[0] + 1.1)
    assert table.capability_of(NEW) is not None
    now[0] += 60.0  # silent past missed_heartbeats x heartbeat_seconds: back, so it arrives again
    assert table.heard(NEW, beat, now[0])


def test_beating_since_starts_at_the_first_heartbeat_even_after_a_capability():
    """``beating_since`` (since when we hear other peers' heartbeats without a break) is set by heartbeats: a
    capability that came first makes its peer look live, and ``hearing_peers_since`` is then never set. A
    coordinator that read it revoked no silent holder's lease (IPIP-0004 §5.3: worker-crash waited out an hour)."""
    now = [100.0]
    table = PeerTable(ME, lambda: now[0], heartbeat_seconds=1.0, missed_heartbeats=5, ours=lambda: None)
    beat = m.Heartbeat(1, 0, ())
    table.told(NEW, sample_capability(), now[0])
    assert table.beating_since is None  # a capability is no heartbeat
    table.heard(NEW, beat, 100.5)
    assert table.beating_since == 100.5 and table.hearing_peers_since is None  # (the election's clock, unchanged)
    table.heard(NEW, beat, 101.5)
    assert table.beating_since == 100.5  # heard without a break: unchanged
    table.heard(NEW, beat, 200.0)  # after a silence (alone meanwhile): hearing again from now
    assert table.beating_since == 200.0


def test_a_peer_restarted_quicker_than_its_silence_arrives_again():
    """Its heartbeat count starts over: it lost every capability it had heard, so it arrives and is told ours. A
    coordinator restarted in 2 s (a silence is 5 heartbeats) heard none for 15 s and refused every claim meanwhile
    (tests/roles/test_resume.py took 43 to 85 s, 22 s after)."""
    now = [100.0]
    table = PeerTable(ME, lambda: now[0], heartbeat_seconds=1.0, missed_heartbeats=5, ours=lambda: None)
    for seq in range(1, 6):
        assert table.heard(NEW, m.Heartbeat(seq, 0, ()), now[0] + seq) == (seq == 1)
    assert table.heard(NEW, m.Heartbeat(1, 0, ()), now[0] + 7.0)  # restarted: counting from 1 again, 2 s later
    assert not table.heard(NEW, m.Heartbeat(2, 0, ()), now[0] + 8.0)
