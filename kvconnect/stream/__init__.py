"""The KV event stream: the publisher (live sends, `replay.py` for fair replay and snapshots,
`state.py` its memory), the subscriber, and `wire.py`, which both sides share (the subscriber
never imports the publisher)."""
