"""Operator-facing views: stats snapshots and the Prometheus collector."""
