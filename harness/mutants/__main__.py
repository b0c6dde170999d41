import sys

from harness.mutants.run import main

sys.exit(main())
