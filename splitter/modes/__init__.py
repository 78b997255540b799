"""The modes: general (with micro-batched pipeline schedules), parameter
server (with the dense parameters on the servers or the workers), embedding
cache and parallel. Each refines `splitting.mode.Mode`'s hooks."""
