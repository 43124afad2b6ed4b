"""Draws docs/assets/forgetting_builtin.png from the "Forgetting" table of docs/measured.md.

The figure plots the values of that table and nothing else (pre-training validation AP50, the
Objects365 stand-in, after each stage of the built-in benchmark's sequence), so the numbers are
written once, in the page. Run from the repository root after the table changes:

  python docs/assets/forgetting_figure.py
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(REPO, "docs", "measured.md")
OUT = os.path.join(REPO, "docs", "assets", "forgetting_builtin.png")
# The table follows this paragraph opening in docs/measured.md.
TABLE_AFTER = "**Forgetting:**"


def read_table(path: str) -> tuple[list[str], dict[str, list[float]]]:
  """(stage names, {run: AP50 per stage}) of the first Markdown table after TABLE_AFTER.

  Raises:
    ValueError: no such paragraph or table in `path`, or a row of another width.
  """
  with open(path) as f:
    text = f.read()
  start = text.find(TABLE_AFTER)
  if start < 0:
    raise ValueError(f"{path}: no paragraph starting {TABLE_AFTER!r}")
  rows = []
  for line in text[start:].splitlines()[1:]:
    if line.startswith("|"):
      rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    elif rows:
      break
  if len(rows) < 3:
    raise ValueError(f"{path}: no table after {TABLE_AFTER!r}")
  header, body = rows[0], rows[2:]
  runs = {}
  for row in body:
    if len(row) != len(header):
      raise ValueError(f"{path}: row {row} has {len(row)} cells, the header {len(header)}")
    runs[row[0]] = [float(v) for v in row[1:]]
  return header[1:], runs


def main() -> None:
  stages, runs = read_table(PAGE)
  fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
  for name, values in runs.items():
    ax.plot(range(len(stages)), values, marker="o", label=name)
  ax.set_xticks(range(len(stages)), stages)
  ax.set_ylim(0, 0.8)
  ax.set_xlabel("after training on")
  ax.set_ylabel("pre-training val AP50")
  ax.set_title("Forgetting on the built-in benchmark (single seed, docs/measured.md)", fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=9)
  fig.tight_layout()
  fig.savefig(OUT)
  print(OUT)


if __name__ == "__main__":
  main()
