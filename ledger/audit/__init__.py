"""Audit: the hash chain's checks, the Merkle tree, signed checkpoints and their sink, proofs, the
archive, the books' audit."""
