"""The KV-aware router: an event-fed block index, prefix scoring, an HTTP front. No torch."""
