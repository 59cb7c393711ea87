"""The request core: the pure walk, selection, worst case, resume, classification, output checks,
the request's budget, and the executor that carries the walk out."""
