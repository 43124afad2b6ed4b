"""Host-side accumulation of retrieval analysis records (paper Figures 3-5).

`RetrievalRecords` takes the per-call record dicts of
`RetrievalAlgorithm.retrieve_with_records` (see `retrieval.compose.RECORD_KEYS`) and keeps
fixed-size histograms, so a dataset of any length costs the same memory; `save` writes them
to one `.npz` file (atomically: temporary file, then rename).

Contents of `<workdir>/records/<dataset>.npz` (every key present for every algorithm; counts
stay 0 where the algorithm does not produce the record):
  calls                 int64 []      retrieval calls recorded
  sampled_class_counts  int64 [C]     replays per class-step class (Fig. 4: SWIL's preference)
  entropy_bin_edges     float64 [51]  bins over [0, 1] of the two entropy histograms
  swil_entropy_counts   int64 [50]    normalised entropies of p_SWIL, one per new image (Fig. 4)
  grasp_entropy_counts  int64 [50]    normalised entropies of the GRASP distributions (Fig. 3)
  used_grasp            int64 [2]     A-SW-GRASP slots that used (SWIL, GRASP)
  knn_sv_bin_edges      float64 [401] bins over [-0.1, 0.1] (values outside fall in the end bins)
  knn_sv_counts         int64 [400]   right-term KNN-SVs of valid candidates (Fig. 5 left)
  min_sv_rank_counts    int64 [R+1]   index r: new images whose lowest-KNN-SV candidate was
                                      the r-th nearest (1 = nearest) (Fig. 5 right)
  selected_rank_counts  int64 [R+1]   index r: replays that were the r-th nearest candidate of
                                      their nearest new image
(R = the candidate set size N_c; ranks beyond R are clipped to R.)
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from owl_cl.utils import atomic_write

ENTROPY_BINS = np.linspace(0.0, 1.0, 51)
KNN_SV_BINS = np.linspace(-0.1, 0.1, 401)


def _histogram(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
  values = np.asarray(values, np.float64).ravel()
  values = values[np.isfinite(values)]
  values = np.clip(values, edges[0], edges[-1])
  return np.histogram(values, bins=edges)[0].astype(np.int64)


class RetrievalRecords:
  """Fixed-size histograms of one dataset's retrieval records.

  Args:
    num_classes: C, the buffer's classes.
    num_candidates: N_c of the ASV algorithms (0 for others): rank histograms get N_c + 1 bins.
  """

  def __init__(self, num_classes: int, num_candidates: int = 0):
    self.num_ranks = max(int(num_candidates), 1)
    self.calls = 0
    self.sampled_class_counts = np.zeros((int(num_classes),), np.int64)
    self.swil_entropy_counts = np.zeros((len(ENTROPY_BINS) - 1,), np.int64)
    self.grasp_entropy_counts = np.zeros_like(self.swil_entropy_counts)
    self.used_grasp = np.zeros((2,), np.int64)
    self.knn_sv_counts = np.zeros((len(KNN_SV_BINS) - 1,), np.int64)
    self.min_sv_rank_counts = np.zeros((self.num_ranks + 1,), np.int64)
    self.selected_rank_counts = np.zeros((self.num_ranks + 1,), np.int64)

  def add(self, records: Mapping[str, np.ndarray], valid: np.ndarray) -> None:
    """Adds one call's records (host numpy arrays) for the replay slots `valid` bool [num]."""
    valid = np.asarray(valid, bool)
    self.calls += 1
    if "sampled_classes" in records:
      classes = np.asarray(records["sampled_classes"])[valid]
      classes = classes[(classes >= 0) & (classes < self.sampled_class_counts.shape[0])]
      np.add.at(self.sampled_class_counts, classes, 1)
    if "swil_entropy" in records:
      self.swil_entropy_counts += _histogram(records["swil_entropy"], ENTROPY_BINS)
    if "grasp_entropy" in records:
      self.grasp_entropy_counts += _histogram(
        np.asarray(records["grasp_entropy"])[valid], ENTROPY_BINS
      )
    if "used_grasp" in records:
      used = np.asarray(records["used_grasp"], bool)[valid]
      self.used_grasp += np.array([np.sum(~used), np.sum(used)], np.int64)
    if "knn_sv" in records:
      sv = np.asarray(records["knn_sv"])[:, np.asarray(records["knn_sv_valid"], bool)]
      self.knn_sv_counts += _histogram(sv, KNN_SV_BINS)
    if "min_sv_rank" in records:
      ranks = np.clip(np.asarray(records["min_sv_rank"]), 0, self.num_ranks)
      np.add.at(self.min_sv_rank_counts, ranks, 1)
    if "selected_rank" in records:
      ranks = np.asarray(records["selected_rank"])[valid]
      np.add.at(self.selected_rank_counts, np.clip(ranks[ranks >= 1], 0, self.num_ranks), 1)

  def as_dict(self) -> dict:
    return dict(
      calls=np.int64(self.calls),
      sampled_class_counts=self.sampled_class_counts,
      entropy_bin_edges=ENTROPY_BINS,
      swil_entropy_counts=self.swil_entropy_counts,
      grasp_entropy_counts=self.grasp_entropy_counts,
      used_grasp=self.used_grasp,
      knn_sv_bin_edges=KNN_SV_BINS,
      knn_sv_counts=self.knn_sv_counts,
      min_sv_rank_counts=self.min_sv_rank_counts,
      selected_rank_counts=self.selected_rank_counts,
    )

  # The accumulated fields (the rest of `as_dict` are constants): a step checkpoint's
  # 'records' item, so a resumed dataset goes on counting from where it stopped.
  STATE_FIELDS = (
    "sampled_class_counts",
    "swil_entropy_counts",
    "grasp_entropy_counts",
    "used_grasp",
    "knn_sv_counts",
    "min_sv_rank_counts",
    "selected_rank_counts",
  )

  def state(self) -> dict[str, np.ndarray]:
    """Copies of the counts so far: `calls` int64 [] and the STATE_FIELDS histograms."""
    return {
      "calls": np.asarray(self.calls, np.int64),  # 0-d: orbax saves no NumPy scalars
      **{k: getattr(self, k).copy() for k in self.STATE_FIELDS},
    }

  def load_state(self, state: dict) -> None:
    """Replaces the counts by `state` (from `state()`).

    Raises:
      ValueError: a field whose shape differs from this recorder's (another buffer).
    """
    for name in self.STATE_FIELDS:
      value = np.asarray(state[name], np.int64)
      if value.shape != getattr(self, name).shape:
        raise ValueError(
          f"records {name}: shape {value.shape}, expected {getattr(self, name).shape}"
        )
      setattr(self, name, value.copy())
    self.calls = int(state["calls"])

  def save(self, path: str) -> None:
    """Writes the histograms to `path` (.npz) atomically (temporary file, then rename)."""
    atomic_write(path, lambda tmp: np.savez(tmp, **self.as_dict()), suffix=".npz")
