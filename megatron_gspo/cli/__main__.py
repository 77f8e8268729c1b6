"""`python -m megatron_gspo.cli ...`: the `megatron-gspo` command."""
import sys

from megatron_gspo.cli import main

sys.exit(main())
