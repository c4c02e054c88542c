"""Response ids that name the server that made them: `resp_<server>_<32 hex>`.

Behind a router (sglang-router, a proxy) the next turn's `previous_response_id` may reach another
server of the fleet. The id says whose it is, so that server answers a useful 404 (the response
belongs to server X: route by `previous_response_id`, or share a store; see docs/operations/fleet.md),
and a router can route by it. The name is `--instance` when one is given, else `<host>-<HTTP port>`,
kept to letters, digits, '.' and '-' (so '_' separates the parts); names should be unique across
the fleet. Ids of the older shape (`resp_<hex>`) and ids from clients that match no shape name no
server: they are only ever looked up, never used as file names or keys unchecked (`parse_id`).
"""

from __future__ import annotations

import re
import socket
import uuid
from typing import NamedTuple

_NAME_CHARS = re.compile(r"[^A-Za-z0-9.-]+")
_MAX_NAME = 64
_ID = re.compile(r"resp_(?:([A-Za-z0-9.-]{1,64})_)?([0-9a-f]{32})")


class ResponseId(NamedTuple):
    """A well-formed response id and the server it names ("" for the older shape)."""

    id: str
    server: str


def server_name(instance: str, http_port: int) -> str:
    """This server's name in its response ids (see the module docstring)."""
    raw = instance or f"{socket.gethostname()}-{http_port}"
    name = _NAME_CHARS.sub("-", raw).strip("-.")[:_MAX_NAME]
    return name or f"port-{http_port}"


def new_response_id(server: str) -> str:
    return f"resp_{server}_{uuid.uuid4().hex}"


def parse_id(response_id: str) -> ResponseId | None:
    """The id's parts, or None when it is no id this API makes (it can then be no one's)."""
    m = _ID.fullmatch(response_id)
    if m is None:
        return None
    return ResponseId(response_id, m.group(1) or "")
