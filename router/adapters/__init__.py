"""State that lives in process or in Redis: breakers, endpoint slots, latency, disabled endpoints,
idempotency; and the providers' report fetchers."""
