"""The HTTP surface: the app (composition root), access, OpenAPI, the query, finance and proof
APIs, the console."""
