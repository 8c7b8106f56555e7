import sys

from spotcr_cli.main import main

sys.exit(main())
