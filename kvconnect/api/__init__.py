"""The OpenAI-compatible API: request validation shared by `serve` and `router`."""
