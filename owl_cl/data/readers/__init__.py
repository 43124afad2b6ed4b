# ruff: noqa: I001  (the import order is the registration order: the kinds as listed)
"""Dataset readers, one module per entry `kind` (big_vision's one module per dataset).

Each module defines its `Reader` (`reader.Reader`: how an entry of its kind is declared,
checked and read) and registers it (`reader.register`) in `reader.READERS`, which
`owl_cl.data.entries`, `owl_cl.benchmark` and validation iterate. Importing this package
registers the built-in kinds below, in this order; a reader of your own is one module that
does the same, imported by your config file (docs/extending.md ("A dataset format")).
"""

from owl_cl.data.readers import coco  # noqa: F401  kind 'coco'
from owl_cl.data.readers import tfds  # noqa: F401  kind 'tfds'
from owl_cl.data.readers import odinw  # noqa: F401  kind 'odinw'
from owl_cl.data.readers import objects365  # noqa: F401  kind 'objects365'
from owl_cl.data.readers import lvis  # noqa: F401  kind 'lvis'
from owl_cl.data.readers import coco2017  # noqa: F401  kind 'coco2017'
from owl_cl.data.readers.reader import READERS
from owl_cl.data.readers.reader import DatasetEntry
from owl_cl.data.readers.reader import Reader
from owl_cl.data.readers.reader import SplitSpec
from owl_cl.data.readers.reader import get
from owl_cl.data.readers.reader import register

__all__ = ["READERS", "DatasetEntry", "Reader", "SplitSpec", "get", "register"]
