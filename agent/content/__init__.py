"""The agent's content room: files by CID, on disk and between peers.

    service.open_content(host, discovery, data_dir, ipfs_api=None) -> ContentService
    ContentService       add_file(path) / add_bytes(data) -> CID (stored, provided in the DHT);
                         fetch(cid, out_path, timeout=, providers=, via="auto"|"blocks"|"bitswap")
                         -> FetchReport; FetchError names the CID, the missing block, each attempt
    blockstore.BlockStore  one file per block, hash-checked on put, temp + rename
    exchange             /infernet/blocks/1.0.0: BlockServer, fetch_from_peer
    bitswap              /ipfs/bitswap/1.2.0 over the BlockStore, our own want-loop
    ipfs_daemon          IpfsDaemon (Kubo HTTP API), hash-checked like any peer
"""
