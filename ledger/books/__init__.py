"""The books: the accounting rules, the balances' edge, settlements of unknown usage, crash
recovery."""
