"""A stand-in for vLLM's OpenAI server module, for tests of `VLLMServer`'s process handling: it takes
the same arguments (only --port and --max-model-len are read), logs a thread-binding line as vLLM
does, starts a helper process in its group as vLLM starts its engine core, and answers /health,
/v1/models and /v1/completions (max_tokens tokens, or one fewer when the prompt is [13])."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send({"data": [{"id": "standin-model"}]} if self.path == "/v1/models" else {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        short = body["prompt"] == [13]
        self._send({"usage": {"completion_tokens": body["max_tokens"] - short}})

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int)
    args, _ = p.parse_known_args()
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"core ids=[0] helper pid={helper.pid}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
