"""structlog configuration for the whole process: console or JSON lines, one level.

Only `configure_logging` lives here; modules get their own `structlog.get_logger(__name__)`.
Prompt and completion text are logged at DEBUG only, by the modules that see them.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info", *, json_lines: bool = False) -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
