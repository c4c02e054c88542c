"""`himamba generate "text"`: stream one completion from a running server to stdout."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import TextIO

from himamba.common.client import Client, GenerateOptions, HimambaError
from himamba.common.config import Config
from himamba.common.types import Usage

_CONNECT_TIMEOUT_S = 3.0
_REPLY_TIMEOUT_S = 600.0  # a server that stays silent this long is stuck or gone


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="himamba generate", description="Generate a completion from a running server.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--port", type=int, default=0, help=f"the server with this HTTP port (default {Config().http.port})")
    p.add_argument("--instance", default="", help="the server with this instance name (`himamba serve --instance`)")
    p.add_argument("--endpoint", default=None, help="the server's client endpoint itself (overrides --port/--instance)")
    p.add_argument("--api-key", default=os.environ.get("HIMAMBA_API_KEY", ""), help="the server's --api-key (default: $HIMAMBA_API_KEY)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (default: the server's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], metavar="S", help="a stop string (repeatable)")
    p.add_argument("--no-stream", action="store_true", help="print the whole answer at the end")
    p.add_argument(
        "--connect-timeout", type=float, default=_CONNECT_TIMEOUT_S, metavar="S", help="seconds to wait for the server"
    )
    return p


def usage_line(usage: Usage | None, finish_reason: str | None) -> str:
    """The one-line summary printed on stderr after the answer."""
    if usage is None:
        return f"finish: {finish_reason}"
    c = usage.cached_tokens
    return (
        f"prompt {usage.prompt_tokens} tokens (cached: device {c.device}, host {c.host}, storage {c.storage}), "
        f"completion {usage.completion_tokens} tokens, finish: {finish_reason}"
    )


def main(argv: list[str] | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run the command; returns the exit code (2: no server, 1: request refused or failed)."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    args = build_parser().parse_args(argv)
    options = GenerateOptions(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    try:
        client = Client(
            args.endpoint, timeout_s=_REPLY_TIMEOUT_S, port=args.port, instance=args.instance, api_key=args.api_key
        )
    except ValueError as e:  # a bad instance name
        print(f"error: {e}", file=err)
        return 2
    with client:
        if not client.wait_connected(args.connect_timeout):
            print(f"no himamba server at {client.endpoint} — start one with `himamba serve`", file=err)
            return 2
        try:
            if args.no_stream:
                done = client.generate(args.prompt, **options)
                out.write(done.text)
                usage, reason = done.usage, done.finish_reason
            else:
                usage, reason = None, None
                with contextlib.closing(client.stream(args.prompt, **options)) as chunks:
                    for chunk in chunks:
                        out.write(chunk.text)
                        out.flush()
                        if chunk.finished:
                            usage, reason = chunk.usage, chunk.finish_reason
        except (HimambaError, TimeoutError) as e:  # refused, failed, or a silent server
            out.write("\n")
            print(f"error: {e}", file=err)
            return 1
        except KeyboardInterrupt:  # closing the stream has aborted the request
            out.write("\n")
            return 130
    out.write("\n")
    out.flush()
    print(usage_line(usage, reason), file=err)
    return 0
