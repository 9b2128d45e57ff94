"""The ready line: what external tools (tests, scripts, `loramux up` users) wait for on stdout.

Its own module so that the service host and the metrics endpoint, which both print it, import neither
each other nor the shell."""


def announce(service: str, host: str, port: int) -> None:
    """Print `<service> listening on HOST:PORT`, flushed."""
    print(f"{service} listening on {host}:{port}", flush=True)
