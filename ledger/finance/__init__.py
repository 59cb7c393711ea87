"""Finance: reconciliation against providers' exports and reports, buckets, periods, repricing,
usage exports."""
