import sys

from harness.soak.run import main

sys.exit(main())
