import sys

from spotcr_agent.cli import main

sys.exit(main(sys.argv[1:]))
