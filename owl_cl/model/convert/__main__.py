"""``python -m owl_cl.model.convert``: see :mod:`owl_cl.model.convert.cli`."""

from owl_cl.model.convert import cli

if __name__ == "__main__":
  cli.main()
