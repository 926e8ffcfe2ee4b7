"""Policy between the HTTP surface and the engine: rate limits, admission, the per-model
queues, routing, coalescing, metrics, and the safety gate (`safety/`).

Nothing here knows HTTP; `api/` wires these pieces into the request path. The ones that depend
on time (token buckets, the waiting room, the queues) take an injected clock, so tests drive
them on a fake one.
"""
