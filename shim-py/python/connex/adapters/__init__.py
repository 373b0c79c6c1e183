"""Adapters that plug Connex into serving engines."""
