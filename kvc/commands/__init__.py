"""The `kvc` subcommands, one module per group; each exposes `register(cli)`."""
