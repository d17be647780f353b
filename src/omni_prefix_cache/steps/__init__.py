"""Per-step bookkeeping under the manager's state lock: the step layout,
step contexts, the write ledger, slot occupancy and input validation."""
