import sys

from artemisd.cli import main

sys.exit(main())
