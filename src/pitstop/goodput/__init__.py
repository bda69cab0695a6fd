"""Where the time went: the per-attempt ledger, the goodput model and interval policy, the sweep report."""
