"""Engine integrations: hicached as a KV tier inside an engine's own interfaces.

Each module imports its engine only when it is imported itself; ``import
hicached`` imports none of them.
"""
