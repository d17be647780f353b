"""The write path below the controller: write tasks, copy queues, staging,
the GPU-byte budget, the committer, the eager dispatch, and the compiled
operations they run."""
