"""infernet wire protocol: pure rules, no I/O.

Nothing in this package imports trio, libp2p, torch or anything from ``agent``. Every module here
is a specification in code; the matching documents live in ``ipips/`` with test vectors.
"""

PROTOCOL_VERSION = 1
