"""The read path: planning a hit's reads, planned reads (copy on write), materialize."""
