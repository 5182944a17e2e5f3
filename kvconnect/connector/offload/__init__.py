"""The offload connector: chunks of KV in cpu, disk and redis tiers, with full event coverage."""
