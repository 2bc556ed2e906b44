import sys

from neutreno.cli.main import main

sys.exit(main())
