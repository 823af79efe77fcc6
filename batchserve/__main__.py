import sys

from batchserve.cli import main

if __name__ == "__main__":  # spawned worker processes (--cascade-workers) re-import this module
    sys.exit(main())
