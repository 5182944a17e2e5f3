"""Storage tiers of the offload connector: cpu, disk, redis."""
