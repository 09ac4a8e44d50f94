"""Audit the layer-wise param sync on real model shapes at real DP, with megatron's own code.

The command line of ``harness.audit.run`` (its docstring: usage, trees, outputs, exit status):

    .venv/bin/python scripts/audit_param_sync.py --help
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.audit.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
