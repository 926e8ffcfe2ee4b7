"""The CLI driven in process, as `server.py keys|orgs|usage ...` parses and runs it."""

from __future__ import annotations

import argparse

from settings import Settings, TierConfig
from store.cli import add_cli, run_cli

SETTINGS = Settings(tiers={"free": TierConfig()})


def cli_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command", required=True))
    return parser


async def run(*argv: str) -> int:
    """The exit status of one CLI command (its output goes to stdout/stderr: capsys reads it)."""
    return await run_cli(cli_parser().parse_args(argv), SETTINGS)
