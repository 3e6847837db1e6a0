import sys

from fa_verify.cli.main import main

sys.exit(main())
