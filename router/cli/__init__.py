"""The `waybill` command, one module per command group."""
