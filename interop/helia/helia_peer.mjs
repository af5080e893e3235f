#!/usr/bin/env node
// A Helia (JS IPFS) peer for Bitswap interop tests against the Python agent.
//
// Rules of this file:
// - The node is minimal on purpose: TCP + Noise + Yamux + identify, Bitswap as the only block
//   broker, no DHT, no HTTP gateways, no bootstrap list. It talks only to the peers it is told to
//   dial (or that dial it), so a test proves Bitswap between the two sides and nothing else.
// - Usage:
//     node helia_peer.mjs serve-add FILE [--layout kubo|kubo-v0|helia]
//         adds FILE with @helia/unixfs, prints one JSON line {cid, peerId, addrs, seconds}, then serves
//         its blocks until stdin closes or SIGTERM/SIGINT arrives.
//         --layout kubo  (default): CIDv1, raw leaves, 256 KiB chunks, balanced, 174 links per node:
//                        what `ipfs add --cid-version=1` (Kubo) builds.
//         --layout kubo-v0: the same tree as CIDv0 with dag-pb leaves: what a plain `ipfs add` builds.
//         --layout helia: @helia/unixfs's own defaults (CIDv1, raw leaves, 1 MiB chunks, 1024 links).
//     node helia_peer.mjs fetch CID MULTIADDR [--timeout SECONDS]
//         dials MULTIADDR (/ip4/.../tcp/.../p2p/<peer id>), cats CID over Bitswap, prints one JSON line
//         {sha256, size, seconds}; exits 1 with {error} on failure or after --timeout (default 60 s).
// - stdout carries only the JSON lines; diagnostics go to stderr.
// - Versions are pinned (package-lock.json) to Helia 5 (@helia/utils 1.4, js-libp2p 2.9, yamux 7,
//   noise 16), which run on Node 20. Helia 7 / js-libp2p 3 declare Node 22 (undici 8 fails at import
//   on Node 20); with @libp2p/http pinned to 2.0.1 and the polyfill below, the same tests passed
//   against Helia 7.1.15 / js-libp2p 3.3.11 too.
import { createHash } from 'node:crypto'
import { setMaxListeners } from 'node:events'
import { createReadStream } from 'node:fs'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { bitswap } from '@helia/block-brokers'
import { libp2pRouting } from '@helia/routers'
import { unixfs } from '@helia/unixfs'
import { Helia } from '@helia/utils'
import { identify } from '@libp2p/identify'
import { tcp } from '@libp2p/tcp'
import { multiaddr } from '@multiformats/multiaddr'
import { MemoryBlockstore } from 'blockstore-core'
import { MemoryDatastore } from 'datastore-core'
import { fixedSize } from 'ipfs-unixfs-importer/chunker'
import { balanced } from 'ipfs-unixfs-importer/layout'
import { createLibp2p } from 'libp2p'
import { CID } from 'multiformats/cid'

// Node 20 lacks Promise.withResolvers (added in Node 22); it-queue, under mortice (Helia's and the
// peer store's locks), calls it at run time. This is the whole of what the Node 22 version does.
Promise.withResolvers ??= function () {
  let resolve, reject
  const promise = new Promise((res, rej) => { resolve = res; reject = rej })
  return { promise, resolve, reject }
}

const LAYOUTS = {
  // Kubo's defaults under --cid-version=1
  kubo: { cidVersion: 1, rawLeaves: true, chunker: fixedSize({ chunkSize: 262144 }), layout: balanced({ maxChildrenPerNode: 174 }) },
  // Kubo's plain `ipfs add`: CIDv0, dag-pb UnixFS leaves
  'kubo-v0': { cidVersion: 0, rawLeaves: false, leafType: 'file', chunker: fixedSize({ chunkSize: 262144 }), layout: balanced({ maxChildrenPerNode: 174 }) },
  // @helia/unixfs's defaults: pass nothing
  helia: {}
}

// The Helia class from @helia/utils is what the `helia` package's createHelia builds; the `helia`
// package itself is not used because its default libp2p pulls WebRTC (a native build from GitHub).
async function startNode () {
  const datastore = new MemoryDatastore()
  const libp2p = await createLibp2p({
    addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] },
    transports: [tcp()],
    connectionEncrypters: [noise()],
    streamMuxers: [yamux()],
    services: { identify: identify() },
    datastore
  })
  const helia = new Helia({
    libp2p,
    datastore,
    blockstore: new MemoryBlockstore(),
    blockBrokers: [bitswap()],
    routers: [libp2pRouting(libp2p)]
  })
  await helia.start()
  return helia
}

function option (args, name, fallback) {
  const i = args.indexOf(name)
  if (i === -1) return fallback
  if (i + 1 >= args.length) throw new Error(`${name} needs a value`)
  return args[i + 1]
}

function print (obj) {
  process.stdout.write(JSON.stringify(obj) + '\n')
}

async function serveAdd (args) {
  const file = args[0]
  const layoutName = option(args, '--layout', 'kubo')
  const layout = LAYOUTS[layoutName]
  if (file == null || layout == null) throw new Error('usage: serve-add FILE [--layout kubo|kubo-v0|helia]')
  const helia = await startNode()
  const started = performance.now()
  const cid = await unixfs(helia).addByteStream(createReadStream(file), layout)
  print({
    cid: cid.toString(),
    peerId: helia.libp2p.peerId.toString(),
    addrs: helia.libp2p.getMultiaddrs().map(String),
    layout: layoutName,
    seconds: (performance.now() - started) / 1000
  })
  const stop = async () => {
    await helia.stop()
    process.exit(0)
  }
  process.on('SIGTERM', stop)
  process.on('SIGINT', stop)
  process.stdin.on('end', stop) // the parent test went away: so do we
  process.stdin.resume()
}

async function fetch (args) {
  const [cidText, addrText] = args
  if (cidText == null || addrText == null) throw new Error('usage: fetch CID MULTIADDR [--timeout SECONDS]')
  const timeout = Number(option(args, '--timeout', '60'))
  const cid = CID.parse(cidText)
  const helia = await startNode()
  const signal = AbortSignal.timeout(timeout * 1000)
  setMaxListeners(Infinity, signal) // every block want listens on it; Node warns past 10
  try {
    const started = performance.now()
    await helia.libp2p.dial(multiaddr(addrText), { signal })
    const hash = createHash('sha256')
    let size = 0
    try {
      for await (const chunk of unixfs(helia).cat(cid, { signal })) {
        hash.update(chunk)
        size += chunk.length
      }
    } catch (err) {
      // an aborted want surfaces as "AggregateError: All promises were rejected": say what happened
      if (signal.aborted) throw new Error(`cat ${cidText}: incomplete after ${timeout} s (${size} bytes)`)
      throw err
    }
    print({ sha256: hash.digest('hex'), size, seconds: (performance.now() - started) / 1000 })
  } finally {
    await helia.stop()
  }
}

const [command, ...rest] = process.argv.slice(2)
const commands = { 'serve-add': serveAdd, fetch }
try {
  if (commands[command] == null) throw new Error('usage: helia_peer.mjs serve-add FILE | fetch CID MULTIADDR')
  await commands[command](rest)
} catch (err) {
  print({ error: `${err.name}: ${err.message}` })
  process.exit(1)
}
