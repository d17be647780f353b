"""The request layer: tenures under owners, their lifecycle events and
per-consumer delivery (spec/request_lifecycle.yaml, spec/delivery.yaml and
their operations in spec/protocol.yaml)."""
