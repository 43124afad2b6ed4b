"""owl_cl.host_memory: freed memory kept by glibc and reused without page faults."""

import os
import subprocess
import sys

import pytest

from owl_cl import host_memory

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Five malloc / touch / free rounds of 200 MiB after one warm-up round; prints the minor page
# faults of the five. glibc's defaults map each round afresh (above the mmap threshold) and
# unmap it on free: 51,200 faults of 4 KiB pages per round.
_ROUNDS = """
import ctypes, resource, sys
from owl_cl import host_memory
if sys.argv[1] == "keep":
  assert host_memory.keep_freed_memory({}) == "set"
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 200 << 20
def once():
  p = libc.malloc(n)
  ctypes.memset(p, 1, n)
  libc.free(p)
once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
  once()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _thp_always() -> bool:
  try:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
      return "[always]" in f.read()
  except OSError:
    return False


def _faults(mode: str) -> int:
  env = dict(os.environ, PYTHONPATH=_REPO)
  for name in host_memory.ENV_VARS:
    env.pop(name, None)
  out = subprocess.run(
    [sys.executable, "-c", _ROUNDS, mode], env=env, capture_output=True, text=True, check=True
  )
  return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
@pytest.mark.skipif(_thp_always(), reason="huge pages on every mapping: few faults either way")
def test_freed_memory_is_reused_without_page_faults():
  pages = 5 * (200 << 20) // 4096  # 256,000: every page of the five rounds faulted afresh
  default = _faults("default")
  if default < pages // 2:
    pytest.skip(f"this libc reuses freed memory by default ({default} faults)")
  # Kept: the rounds reuse the pages the warm-up round mapped (a few faults of Python itself).
  assert _faults("keep") < pages // 100


def test_a_users_own_malloc_settings_are_left_alone():
  environ = {"MALLOC_ARENA_MAX": "2", "PATH": "/bin"}
  assert host_memory.keep_freed_memory(environ) == "left to the environment (MALLOC_ARENA_MAX)"


def test_nothing_is_set_off_linux(monkeypatch):
  monkeypatch.setattr(sys, "platform", "darwin")
  assert host_memory.keep_freed_memory({}) == "not Linux"
