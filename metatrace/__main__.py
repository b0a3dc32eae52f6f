import sys

from metatrace.cli import main

sys.exit(main())
