"""HTTP transport of `kvconnect serve` and `kvconnect router`: servers, limits, deadlines, the
access log, bearer auth, and the router's client towards its instances. What is said over it
(the OpenAI protocol) is `api/`; no engine, no torch."""
