"""`python -m stallfree.cli ...`: the same dispatcher as the `stallfree` console script."""
import sys

from stallfree.cli import main

sys.exit(main())
