"""Speculative decoding: proposers (ngram, self_spec), device-side acceptance and the engine's side of it."""
