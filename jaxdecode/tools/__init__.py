"""The `jaxdecode` command and its tools (benchmark, sweep): the layer above the core and models."""
