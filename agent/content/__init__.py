"""The agent's content room: on-disk blockstore, fetch/serve by CID (our stream protocol, Bitswap, IPFS daemon)."""
