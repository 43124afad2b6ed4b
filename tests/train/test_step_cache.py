"""`step_cache.shared`: one build per equal key, the newest entries kept, nothing kept on error."""

import pytest

from owl_cl.train import step_cache


def test_one_build_per_equal_key():
  built = []
  first = step_cache.shared(("k", 1), lambda: built.append(1) or object())
  assert step_cache.shared(("k", 1), lambda: built.append(2) or object()) is first
  assert step_cache.shared(("k", 2), lambda: built.append(3) or object()) is not first
  assert built == [1, 3] and step_cache.size() == 2
  step_cache.clear()
  assert step_cache.size() == 0
  assert step_cache.shared(("k", 1), lambda: "rebuilt") == "rebuilt"


def test_the_newest_entries_are_kept(monkeypatch):
  monkeypatch.setattr(step_cache, "MAX_ENTRIES", 3)
  for i in range(4):
    step_cache.shared(i, lambda i=i: f"v{i}")
  step_cache.shared(1, lambda: "unused")  # a hit makes 1 the newest
  step_cache.shared(4, lambda: "v4")  # evicts the oldest: 2
  assert step_cache.size() == 3
  assert step_cache.shared(1, lambda: "new") == "v1"
  assert step_cache.shared(2, lambda: "new") == "new"


def test_a_failing_build_keeps_nothing_and_a_bad_key_is_refused():
  def fail():
    raise RuntimeError("no")

  with pytest.raises(RuntimeError, match="no"):
    step_cache.shared("k", fail)
  assert step_cache.size() == 0
  with pytest.raises(TypeError):
    step_cache.shared({"a": 1}, lambda: 1)
