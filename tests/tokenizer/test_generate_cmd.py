"""`himamba generate`: streams to stdout, usage on stderr, a clear message when no server runs."""

from __future__ import annotations

import io
import uuid
from typing import Any

from himamba.services.generate_cmd import main


def test_streams_the_answer_and_prints_usage(server: Any) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = main(["def f():", "--endpoint", server.endpoint, "--max-tokens", "30", "--seed", "1"], out, err)
    assert code == 0, err.getvalue()
    assert out.getvalue() == server.reply_text + "\n"
    c = server.cached
    assert f"cached: device {c.device}, host {c.host}, storage {c.storage}" in err.getvalue()
    assert f"completion {len(server.reply_ids)} tokens" in err.getvalue()
    assert "finish: length" in err.getvalue()


def test_no_stream_and_stop_strings(server: Any) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = main(["x", "--endpoint", server.endpoint, "--no-stream", "--stop", "日本", "--stop", "wörld"], out, err)
    assert code == 0, err.getvalue()
    assert out.getvalue() == "héllo \n"
    assert "finish: stop" in err.getvalue()


def test_a_refused_request_exits_1(server: Any) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert main(["x", "--endpoint", server.endpoint, "--temperature", "-1"], out, err) == 1
    assert "error: [400]" in err.getvalue() and "temperature" in err.getvalue()


def test_no_server_exits_2_with_a_hint() -> None:
    endpoint = f"ipc://@himamba-test-nobody-{uuid.uuid4().hex}"
    out, err = io.StringIO(), io.StringIO()
    assert main(["hello", "--endpoint", endpoint, "--connect-timeout", "0.3"], out, err) == 2
    assert f"no himamba server at {endpoint}" in err.getvalue()
    assert "himamba serve" in err.getvalue()
    assert out.getvalue() == ""
