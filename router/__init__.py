"""Waybill gateway: HTTP app, config, routing policy, drivers, breakers."""
