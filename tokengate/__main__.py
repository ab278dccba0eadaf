import sys

from tokengate.cli import main

sys.exit(main())
