import sys

from ov_kvcrush.cli import main

sys.exit(main())
