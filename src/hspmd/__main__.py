import sys

from hspmd.cli import main

sys.exit(main())
