"""Logging setup: every line names the service that wrote it."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-5s [%(service)s:%(process)d] %(name)s: %(message)s"


class _ServiceFilter(logging.Filter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        return True


def setup_logging(service: str, level: str = "info") -> logging.Logger:
    """Configure the root logger of this process for `service`; returns the service's logger."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_ServiceFilter(service))
    root.addHandler(handler)
    root.setLevel(os.environ.get("HIMAMBA_LOG_LEVEL", level).upper())
    return logging.getLogger(f"himamba.{service}")
