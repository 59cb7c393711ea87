"""The doors: one translator per client API, from the wire to the core's request and back."""
