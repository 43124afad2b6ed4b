"""`python -m owl_cl.report DIR... [--reference uniform]`: the report of repeated runs.

The command line of `owl_cl.analysis.report` (docs/experiments.md, "Report").
"""

from owl_cl.analysis.report import main

if __name__ == "__main__":
  raise SystemExit(main())
