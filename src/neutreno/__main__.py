import sys

from neutreno.cli.main import run

sys.exit(run())
