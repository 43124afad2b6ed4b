"""`run_spec.RunSpec.seed_of`: each part's seed from the typed top-level fields."""

from __future__ import annotations

import pytest

from owl_cl import config_fields
from owl_cl import run_spec
from owl_cl.configs import base


@pytest.mark.parametrize("seeds", [{}, {"data": 7}, {"model": 0, "retrieval": 11}])
def test_seed_of_is_config_fields_rule_on_the_typed_fields(seeds):
  config = base.get_config("")
  config.seed = 3
  for part, value in seeds.items():
    config.seeds[part] = value
  settings = run_spec.run_settings(config)
  for part in config_fields.SEED_PARTS:
    # Worked by hand: a part's own seed when set (0 too), else `seed`.
    assert settings.seed_of(part) == seeds.get(part, 3)
    assert settings.seed_of(part) == config_fields.seed_of(config, part)
  with pytest.raises(ValueError, match="unknown seed part 'buffer'"):
    settings.seed_of("buffer")
