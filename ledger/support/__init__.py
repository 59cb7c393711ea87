"""Generic helpers with no domain of their own: copying frozen records, process settings."""
