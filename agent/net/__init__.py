"""The agent's network room: libp2p host, signed gossip, DHT discovery (see network.py)."""
