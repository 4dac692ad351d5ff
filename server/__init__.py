"""engramd daemon: config, host table store, device backends, request loop, CLI."""
