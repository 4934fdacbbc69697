import sys

from hicached.cli import main

sys.exit(main())
