"""Tests of owl_cl.eval.forgetting on a hand-worked matrix."""

import math

import numpy as np
import pytest

from owl_cl.eval import forgetting as fl

# Stages: 0 = pre-trained, 1 = after D1, 2 = after D2. Columns: P (pre-training set), D1, D2.
A = np.array(
  [
    [0.50, 0.10, 0.20],
    [0.30, 0.60, 0.25],
    [0.20, 0.40, 0.70],
  ]
)
TRAINED_AT = [0, 1, 2]


def test_forgetting_hand_worked():
  f = fl.forgetting(A, TRAINED_AT)
  # P: max(0.5, 0.3) - 0.2 = 0.3; D1: A[1,1] - A[2,1] = 0.6 - 0.4 = 0.2; D2: learned last.
  np.testing.assert_allclose(f[:2], [0.3, 0.2])
  assert math.isnan(f[2])
  np.testing.assert_allclose(fl.forgetting(A, TRAINED_AT, since="all")[:2], [0.3, 0.2])
  assert fl.average_forgetting(A, TRAINED_AT) == pytest.approx(0.2)


def test_bwt_fwt_retained_mean_hand_worked():
  assert fl.backward_transfer(A, TRAINED_AT) == pytest.approx(0.4 - 0.6)
  assert fl.forward_transfer(A, TRAINED_AT) == pytest.approx(0.25 - 0.20)
  np.testing.assert_allclose(fl.retained_fraction(A), [0.4, 4.0, 3.5])
  assert fl.downstream_mean(A, TRAINED_AT) == pytest.approx((0.4 + 0.7) / 2)
  assert fl.downstream_mean(A, TRAINED_AT, stage=0) == pytest.approx((0.1 + 0.2) / 2)


def test_since_all_uses_zero_shot_stage():
  B = A.copy()
  B[0, 1] = 0.9  # zero-shot D1 better than after training on it
  assert fl.forgetting(B, TRAINED_AT)[1] == pytest.approx(0.2)
  assert fl.forgetting(B, TRAINED_AT, since="all")[1] == pytest.approx(0.5)


def test_nan_safety():
  B = A.copy()
  B[1, 0] = np.nan  # P not evaluated after stage 1
  B[1, 1] = np.nan  # D1 not evaluated right after learning it
  f = fl.forgetting(B, TRAINED_AT)
  assert f[0] == pytest.approx(0.3)  # max over the remaining stage 0
  assert math.isnan(f[1])
  assert math.isnan(fl.average_forgetting(B, TRAINED_AT))
  assert math.isnan(fl.backward_transfer(B, TRAINED_AT))
  B[2, 2] = np.nan
  assert math.isnan(fl.downstream_mean(B, TRAINED_AT))
  assert fl.downstream_mean(B, TRAINED_AT, skipna=True) == pytest.approx(0.4)
  C = A.copy()
  C[0, 0] = 0.0
  assert math.isnan(fl.retained_fraction(C)[0])
  # A single stage: nothing defined, no crash, no warning.
  with np.errstate(all="raise"):
    assert np.isnan(fl.forgetting(A[:1], [0, 0, 0])).all()
    assert math.isnan(fl.backward_transfer(A[:1], [0, 0, 0]))


def test_accuracy_matrix_forms_and_trained_at():
  stages = [
    {"name": "pretrained", "metrics": {"P": {"AP": 0.5}, "D1": {"AP": 0.1}, "D2": {"AP": 0.2}}},
    {"name": "D1", "metrics": {"P": {"AP": 0.3}, "D1": {"AP": 0.6}, "D2": {"AP": 0.25}}},
    {"name": "D2", "metrics": {"P": {"AP": 0.2}, "D1": {"AP": 0.4}, "D2": {"AP": 0.7}}},
  ]
  M, names, sets = fl.accuracy_matrix(stages)
  np.testing.assert_allclose(M, A)
  assert names == ["pretrained", "D1", "D2"] and sets == ["P", "D1", "D2"]
  as_dict = {s["name"]: {k: v["AP"] for k, v in s["metrics"].items()} for s in stages}
  M2, _, _ = fl.accuracy_matrix(as_dict, ["D2", "P"])
  np.testing.assert_allclose(M2, A[:, [2, 0]])
  stages[1]["metrics"]["P"]["AP"] = None
  M3, _, _ = fl.accuracy_matrix(stages)
  assert math.isnan(M3[1, 0])
  np.testing.assert_array_equal(fl.trained_at_from_names(names, sets), [0, 1, 2])
  np.testing.assert_array_equal(
    fl.trained_at_from_names(names, ["P", "d1_test"], downstream={"d1_test": "D1"}), [0, 1]
  )
  # A downstream set whose stage has not run yet counts as not trained.
  np.testing.assert_array_equal(
    fl.trained_at_from_names(names[:2], sets, downstream=["D1", "D2"]), [0, 1, 0]
  )


def test_summary_and_errors():
  s = fl.forgetting_summary(A, ["pre", "D1", "D2"], ["P", "D1", "D2"], TRAINED_AT)
  assert s["per_set"]["P"]["forgetting"] == pytest.approx(0.3)
  assert s["per_set"]["D1"]["trained_at"] == "D1"
  assert s["per_set"]["P"]["trained_at"] is None
  assert s["per_set"]["D1"]["best_before_final"] == pytest.approx(0.6)
  assert s["bwt"] == pytest.approx(-0.2)
  assert s["average_forgetting"] == pytest.approx(0.2)
  assert s["downstream_mean_final"] == pytest.approx(0.55)
  assert s["num_downstream"] == 2 and s["final_stage"] == "D2"
  with pytest.raises(ValueError):
    fl.forgetting(A, [0, 1])
  with pytest.raises(ValueError):
    fl.forgetting(A, [0, 1, 3])
  with pytest.raises(ValueError):
    fl.forgetting(A, TRAINED_AT, since="later")
