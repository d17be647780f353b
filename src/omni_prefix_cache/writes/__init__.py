"""The write path below the controller: write tasks and their chunks, the
task registry, copy queues, staging, the GPU-byte budget, the copy stage
(host rows), the pool writer, the committer, the eager dispatch, and the
compiled operations and effect handlers they run."""
