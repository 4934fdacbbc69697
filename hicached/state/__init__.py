"""The daemon's data structures: the slot pool, the page indexes, L2 (tenants'
books, allocation and eviction) and the set of keys L3 holds. Synchronous,
no I/O, no policy; owned by the event-loop thread."""
