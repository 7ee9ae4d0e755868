"""The server side of the swarm: a span of blocks, its sessions' caches, and the batched step."""
