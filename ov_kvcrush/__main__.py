import sys

from ov_kvcrush.cli.main import main

sys.exit(main())
