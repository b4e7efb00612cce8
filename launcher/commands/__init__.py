"""One module per `elastic` subcommand, each with `add_arguments(parser)` and `run(args) -> int`."""
