"""python -m collserve launch ... (the `collserve` command)."""
import sys

from .cli import main

sys.exit(main())
