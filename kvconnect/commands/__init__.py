"""The commands `cli.py` runs: flags become objects here, and only here are servers and
threads started from flags. Libraries never import this package."""
