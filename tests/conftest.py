"""Session fixtures shared by the end-to-end tests (what is expensive to build, built once).

Under pytest-xdist (`-n 2`) every worker is its own process with its own session: what is
built once per session here is built once for all workers, in a folder of the run's base
temp root that the workers share (`_shared_root`), by whichever worker comes first while the
others wait for its lock (`utils.cache_entry_lock`). docs/tests.md has the measured costs.
"""

# ruff: noqa: E402 (the imports below follow the XLA flags, set before JAX starts)
import os
import pathlib
import shutil

# XLA:CPU compiles the test session's programs without LLVM's optimisation passes and with
# its elemental IR emitters instead of the MLIR fusion emitters: compiling, not running, is
# most of the tiny programs' time (a tiny `swil` run from an empty compilation cache: 22 s
# with the fusion emitters, 13 s without; docs/tests.md). Neither changes the HLO; both may
# change the last bits of float32 results (no fast math either way), so every process of a
# test must share them. Set before JAX creates its CPU client, in this process and, through
# the environment, in every subprocess the tests start (a test that adds its own flags
# appends them).
TEST_XLA_FLAGS = (
  "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  " --xla_cpu_use_fusion_emitters=false"
)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax
from jax._src import compilation_cache  # reset_cache: no public equivalent
import pytest

from owl_cl import benchmark
from owl_cl import cache_keys
from owl_cl import pretrained
from owl_cl import utils
from owl_cl.detector import Detector
from owl_cl.replay import setup as replay_setup
from owl_cl.testing.configs import load_config
from owl_cl.testing.configs import tiny_config
from owl_cl.train import step_cache

# Every compiled program is written to the cache, however fast it compiled: the suite's
# thousands of small programs (eager operations, helpers) are written once and read by the
# other worker, the subprocesses and later tests. Writing them took as much CPU as compiling
# them (27.5 s and 28.5 s in a profile of the whole suite), but not writing those under 0.1 s
# made the suite's short tests 20-25% slower in two clean-clone runs (docs/tests.md).
MIN_COMPILE_SECS = 0.0
# A compilation cache folder kept across pytest runs (docs/tests.md); unset: one per run.
XLA_CACHE_KEEP_ENV = "OWL_CL_TEST_XLA_CACHE"


def _shared_root(tmp_path_factory) -> pathlib.Path:
  """The folder every worker process of this pytest run shares.

  pytest-xdist gives each worker the base temp `<root>/popen-gw<N>` of the run's `<root>`;
  without xdist the base temp is the run's own.
  """
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def xla_cache_dir(tmp_path_factory) -> str:
  """The run's persistent XLA compilation cache, shared by every test, worker and subprocess.

  The tiny configs compile the same programs (same shapes) test after test: a program
  compiled once is read back afterwards instead of compiled again (XLA's compile is most of
  a tiny run's CPU time). Every compilation is kept (`MIN_COMPILE_SECS`). JAX reads
  the folder once per process, at its first compilation: a test that sets
  `compilation_cache_dir` (as `experiment.run` applies it) still uses this one, unless it
  calls `compilation_cache.reset_cache()` (tests/e2e/test_lookahead.py restores it after).
  Loaded executables are the compiled ones byte for byte: results do not change. A process
  that reads an entry another one is still writing compiles the program instead (JAX warns
  and goes on).
  """
  # OWL_CL_TEST_XLA_CACHE: a folder kept across pytest runs (the inner loop's reruns compile
  # only what changed); CI leaves it unset: each run starts from an empty cache.
  folder = os.environ.get(XLA_CACHE_KEEP_ENV) or str(_shared_root(tmp_path_factory) / "xla")
  os.makedirs(folder, exist_ok=True)
  _use_xla_cache(folder)
  # The session's subprocesses (`owl_cl.main`, sweeps, benchmark smoke runs): JAX reads these
  # when imported.
  os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(MIN_COMPILE_SECS)
  return folder


def _use_xla_cache(folder: str) -> None:
  """Points this process's JAX at the compilation cache `folder` (`MIN_COMPILE_SECS`)."""
  jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
  compilation_cache.reset_cache()  # decided again at the next compilation, with the folder


@pytest.fixture(autouse=True)
def _fresh_step_cache():
  """Each test starts with no shared jitted steps (`owl_cl.train.step_cache`): a step that
  another test built (perhaps under its monkeypatches) is never reused, so no test depends on
  which ran before it in the worker. The runs within one test still share theirs."""
  step_cache.clear()
  yield
  step_cache.clear()


@pytest.fixture(autouse=True)
def _keep_xla_cache(xla_cache_dir):
  """Restores the session's compilation cache after a test that changed JAX's settings.

  `experiment.run` with a `compilation_cache_dir` sets JAX's process-wide cache settings (its
  folder, a 1 s minimum compile time); later tests of the worker would inherit them.
  """
  yield
  if (
    jax.config.jax_compilation_cache_dir != xla_cache_dir
    or jax.config.jax_persistent_cache_min_compile_time_secs != MIN_COMPILE_SECS
  ):
    _use_xla_cache(xla_cache_dir)


# The default cache of configs/base.py, in the user's home: no test may write there (a test
# that loads data sets its config's `cache_dir` to a folder of its own).
HOME_CACHE = utils.expand_path(load_config("base").cache_dir)


@pytest.fixture(autouse=True)
def _home_cache_untouched():
  """Fails the test after which the user's default cache (`HOME_CACHE`) exists when it did not
  before: a test (or one running beside it on the other xdist worker) wrote outside its own
  folders, e.g. generated the full built-in benchmark (about 25 s and 136 MB) into it."""
  existed = os.path.exists(HOME_CACHE)
  yield
  if not existed and os.path.exists(HOME_CACHE):
    pytest.fail(
      f"{HOME_CACHE} was created during this test (or one beside it on another worker): "
      "set the config's cache_dir to a folder under tmp_path"
    )


@pytest.fixture(scope="session")
def pretrained_cache_dir(tmp_path_factory) -> str:
  """A cache folder holding the built-in benchmark, the tiny configs' pre-trained model and
  the `swil` tiny config's replay store.

  Every `tiny_config` (whatever the retrieval) shares the pre-training settings, so runs with
  this cache load the model instead of pre-training it; tests never depend on one another
  to have filled it. Built once per pytest run (`_shared_root`, under its lock) and copied
  to a folder of this worker's own: what a test adds to it (another store, a scan record)
  stays in the worker, and no test copies a folder that another worker is writing.
  """
  built = str(_shared_root(tmp_path_factory) / "pretrained_cache")
  with utils.cache_entry_lock(built, "session's pre-trained cache"):
    done = os.path.join(built, "COMPLETE")
    if not os.path.exists(done):
      shutil.rmtree(built, ignore_errors=True)  # a worker killed while building it
      config = tiny_config("swil", built)
      detector = Detector(config)
      bench = benchmark.load_benchmark(config)
      params, meta = pretrained.pretrained_params(detector, bench, None)
      key = cache_keys.buffer_key_material(config, bench.pretrain.train, meta)
      replay_setup.build_store(detector, bench, params, key_material=key)
      open(done, "w").close()
  cache_dir = str(tmp_path_factory.mktemp("cache"))
  shutil.copytree(built, cache_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("COMPLETE"))
  return cache_dir


def pytest_collection_modifyitems(config, items):
  """Modules with a `slow` test run first, their slow tests first within them.

  Under `-n 2` the workers take the next tests as they finish (pytest.ini: one at a time):
  the long end-to-end tests start while the many short ones fill the other worker, instead
  of one of them starting last while the other worker sits idle. Whole modules move, so a
  module's fixtures are still set up once per worker. The order is the same in every worker
  (xdist requires it) and no test depends on it.
  """
  del config  # unused
  slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
  first = {}
  for index, item in enumerate(items):
    first.setdefault(item.module.__name__, index)
  items.sort(
    key=lambda item: (
      item.module.__name__ not in slow_modules,
      first[item.module.__name__],
      item.get_closest_marker("slow") is None,
    )
  )
