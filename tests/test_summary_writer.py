"""The run's TensorBoard writer writes scalars TensorBoard reads (that importing it leaves
torch unimported: tests/e2e/test_startup.py)."""

import os
import struct


def _events(path):
  """The `Event` protos of a TFRecord file (length u64, its CRC u32, data, the data's CRC u32)."""
  from tensorboardX.proto import event_pb2

  with open(path, "rb") as f:
    data = f.read()
  events, at = [], 0
  while at < len(data):
    (length,) = struct.unpack("<Q", data[at : at + 8])
    event = event_pb2.Event()
    event.ParseFromString(data[at + 12 : at + 12 + length])
    events.append(event)
    at += 12 + length + 4
  return events


def test_scalars_are_written_as_tensorboard_events(tmp_path):
  from owl_cl.summary_writer import SummaryWriter

  writer = SummaryWriter(str(tmp_path))
  writer.add_scalar("train/loss", 0.25, 3)
  writer.add_scalar("train/loss", 0.125, 4)
  writer.close()
  (name,) = os.listdir(tmp_path)
  values = [
    (event.step, value.tag, value.simple_value)
    for event in _events(tmp_path / name)
    for value in event.summary.value
  ]
  # Both values are exact in float32.
  assert values == [(3, "train/loss", 0.25), (4, "train/loss", 0.125)]
