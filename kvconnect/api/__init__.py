"""The OpenAI-compatible API: request validation shared by `serve` and `router`. The protocol
only; how it travels (servers, limits, auth, the upstream client) is `kvconnect/http/`."""
