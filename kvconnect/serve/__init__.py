"""One instance's OpenAI-compatible HTTP server: `server.py` (the handlers), `engine_loop.py`
(the engine on its own thread), `metrics.py` (`/metrics`)."""
