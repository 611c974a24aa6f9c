"""``dsa-determinism``: slime's DSA indexer (GLM-5 / DeepSeek-V3.2) selects with the deterministic top-k."""
