import sys

from harness.compare.runner import main

sys.exit(main())
