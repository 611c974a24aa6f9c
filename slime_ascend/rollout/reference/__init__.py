"""The CPU reference engine: a tiny Qwen3-shaped model (model) served on SGLang's HTTP surface (engine)."""
