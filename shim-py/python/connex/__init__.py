"""Connex: the Python side of P/D disaggregated serving with request resume.

`connex._transfer` (built from Rust by maturin) holds and pulls KV blocks; see
docs/transfer.md.
"""
