"""The Alembic script directory of the ledger: ``env.py``, the revision template and
``versions/``, the only place the schema changes.

Nothing imports this package; :func:`ledger.db.migrate` points Alembic at its folder
(``ledger.db.ALEMBIC_DIR``). It lives inside ``ledger`` so that the wheel carries it and an
installed Waybill migrates exactly as a checkout does.
"""
