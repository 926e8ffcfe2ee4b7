"""Policy between the HTTP surface and the engine: rate limits, queues, routing, coalescing.

Every piece here is a library with an injected clock; `api/` wires them into the request path.
"""
