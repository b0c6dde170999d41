import sys

from harness.sharing.run import main

sys.exit(main())
