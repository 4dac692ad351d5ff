"""What the client and the daemon share: not an API.

The wire (`protocol`, `messages`, `connection`, `handles`), the served slab and its counters
(`slab`, `host_counters`), the mapped tables (`mapped`, `shared_mapping`, `huge_pages`), the
client's hot-row cache keeper, and the CUDA, pinning and MPS helpers both sides call (`cuda`,
`host_pin`, `libc`, `mps`, `ids`). A user imports `engramd.client`; these modules may change
with any release, in step on both sides of the socket.
"""
