"""The serving processes: uvicorn's options, the workers of `waybill serve --workers N`."""
