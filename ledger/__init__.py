"""Waybill books: events, the append-only store, accounting, projections, queries."""
