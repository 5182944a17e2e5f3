"""The engine: block pool, KV cache manager, scheduler, TP workers, executor and `LLM`."""
