"""`python -m testing.fake_server [--token-delay-s S] [--max-num-running N] [--fake NAME]... SERVER_ARGS...`

server.py with the models of backend "native" (or only those named by --fake) served by the
echoing fake of testing/fake_backend.py: a real server process, with answers an end-to-end or
browser test chooses through its prompt. A faked model's folder needs only a tokenizer. Test-only.
"""

from __future__ import annotations

import argparse
import os
import sys

import server
from testing.fake_backend import FakeBehaviour, fake_backends


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="testing.fake_server", allow_abbrev=False, add_help=False)
    parser.add_argument("--token-delay-s", type=float, default=0.0, help="sleep before each token")
    parser.add_argument("--max-num-running", type=int, default=0, help="streams at once; 0: unlimited")
    parser.add_argument("--fake", action="append", metavar="NAME", help="fake only this model (repeatable)")
    fake, server_args = parser.parse_known_args(argv)
    behaviour = FakeBehaviour(token_delay_s=fake.token_delay_s, max_num_running=fake.max_num_running)
    return server.main(server_args, backend_factory=fake_backends(behaviour, fake.fake))


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # as server.py: skip the interpreter's slow teardown
