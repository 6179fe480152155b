"""One module per verb; each returns a result dataclass that cli.py renders."""
