import sys

from target_server.data.cli import main

sys.exit(main())
