"""What the daemon and its clients agree on: the protocol's messages, namespaces
and page keys, the shared arena's layout and its generation header, and KV
events in vLLM's wire format. Imports nothing from the layers above it."""
