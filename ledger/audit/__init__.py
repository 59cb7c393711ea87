"""Audit: the hash chain's checks, the Merkle tree, signed checkpoints and their sink, proofs,
archiving months (the archived files themselves are ``ledger.store.archived``), the books'
audit."""
