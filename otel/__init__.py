"""Traces and metrics, derived from ledger events."""
