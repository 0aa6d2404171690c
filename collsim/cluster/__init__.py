"""The machine: devices as data, the topology (links and paths, read once and immutable), the
transports of the inter-node fabrics and the flow-level network that shares links between
transfers."""
