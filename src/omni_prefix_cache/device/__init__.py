"""Device-facing pieces: the copy engine (streams, events, pinned memory), the sync factories, index tensors."""
