"""The `loramux` command line (the shell): flags and `LORAMUX_*` variables read once, the subcommands, and
`up`. It imports the services and the shared host; nothing outside the shell imports it."""
