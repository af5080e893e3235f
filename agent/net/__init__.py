"""The agent's network room: py-libp2p host, signed gossip, DHT discovery.

    network.open_network(identity, NetConfig, GossipConfig) -> Network(host, gossip, discovery)
    host.Host            peer_id, addrs(), connected_peers(), connect(), open_stream(),
                         set_handler(protocol, handler, timeout=), nursery, guard (failures per peer)
    gossip.Gossip        subscribe(topic) -> Subscription of Received(topic, message, envelope,
                         forwarder, signer); publish(message) -> message ID; invalid/reasons/
                         rate_limited/dropped counters
    discovery.Discovery  advertise_worker(), find_workers(), provide(cid), find_providers(cid),
                         find_peer(peer_id), maintain(advertise=, interval=)
    streams              HandlerGuard, FrameReader (bounded length prefixes), frame()
    errors               NetError, NetConfigError, PeerProtocolError
"""
