"""The daemon process: its lifecycle and request loop (server), access control
(tenants), the L3 tier's I/O side (tier, dispatcher), the KV event publisher,
Prometheus metrics and systemd notification."""
