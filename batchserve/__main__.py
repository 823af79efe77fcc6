import sys

from batchserve.cli import main

sys.exit(main())
