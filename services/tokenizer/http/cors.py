"""CORS for the HTTP API (`--allowed-origins`), as vLLM's (Starlette's CORSMiddleware) answers it.

With no allowed origins nothing changes: no CORS header is sent and OPTIONS is a 405, so a
browser page from another origin cannot read the API. With some, a response to an allowed
`Origin` carries `Access-Control-Allow-Origin` (the origin itself, or `*` when any origin is
allowed) and a preflight (OPTIONS with `Access-Control-Request-Method`) is answered here,
before the API key is checked (browsers send no credentials on a preflight): 200 with the
methods and the requested headers allowed, or 400 for an origin that is not allowed.
Credentials (cookies) are never allowed: the API authenticates with a bearer key.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
_MAX_AGE_S = "600"


def parse_origins(value: str) -> frozenset[str]:
    """`--allowed-origins`: comma-separated origins, or a JSON list of them (vLLM's spelling)."""
    value = value.strip()
    if value.startswith("["):
        try:
            items = json.loads(value)
        except ValueError as e:
            raise ValueError(f"--allowed-origins: not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
            raise ValueError("--allowed-origins: a JSON list must hold strings")
    else:
        items = value.split(",")
    return frozenset(o.strip().rstrip("/") for o in items if o.strip())


class Cors:
    """The allowed origins, a middleware answering preflights, and a hook adding the headers to
    every response (streams included: it runs before their headers are sent)."""

    def __init__(self, allowed_origins: str):
        self.origins = parse_origins(allowed_origins)
        self.any_origin = "*" in self.origins

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def allows(self, origin: str) -> bool:
        return self.any_origin or origin.rstrip("/") in self.origins

    def install(self, app: web.Application) -> None:
        """Answer preflights first (before any other middleware) and add headers to responses."""
        if not self.enabled:
            return
        app.middlewares.insert(0, self._preflight)
        app.on_response_prepare.append(self._add_headers)

    @web.middleware
    async def _preflight(self, request: web.Request, handler: Any) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        wanted_method = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or wanted_method is None:
            return await handler(request)
        if not self.allows(origin):
            return web.Response(status=400, text="Disallowed CORS origin")
        headers = {
            "Access-Control-Allow-Methods": _METHODS,
            "Access-Control-Max-Age": _MAX_AGE_S,
        }
        wanted_headers = request.headers.get("Access-Control-Request-Headers")
        if wanted_headers:
            headers["Access-Control-Allow-Headers"] = wanted_headers
        return web.Response(status=200, text="OK", headers=headers)

    async def _add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or not self.allows(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = "*" if self.any_origin else origin
        if not self.any_origin:
            response.headers.add("Vary", "Origin")  # caches must not serve one origin's answer to another
