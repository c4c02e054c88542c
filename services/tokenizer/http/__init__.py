"""The tokenizer service's HTTP front door: OpenAI-compatible API, /health and /metrics."""
