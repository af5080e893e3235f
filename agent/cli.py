"""The ``infernet`` command line: a thin face over the agent."""

from __future__ import annotations

import argparse
import sys

from agent import __version__
from protocol import PROTOCOL_VERSION


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infernet",
        description="Peer-to-peer agent that trains LoRA adapters across many machines.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"infernet-agent {__version__} (protocol v{PROTOCOL_VERSION})",
    )
    parser.add_argument("--verbose", action="store_true", help="show tracebacks and debug output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("demo", help="run the demo network on loopback (1 submitter + 3 workers)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "demo":
        print("infernet: the demo network is not available in this build yet", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
